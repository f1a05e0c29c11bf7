"""Plan shipped configs with `mtune plan` for a CUDA target and record what planning costs: wall time and the
planner process's peak resident memory (it must stay small: fake tensors allocate nothing).

Each config is planned in its own process, as a user would run it, with the model named by family and size
(`model.size`), so no checkpoint needs to be downloaded: the planner reads only a model's shape, never its weights.
A distributed config is planned per rank for the number of processes its header runs it on.

    python benchmarks/plan_configs.py [CONFIG ...] [--out benchmarks/results/plan_configs.json] [--fit 24GiB]
        [--set KEY=VALUE ...]

Default: the shipped Llama 3.1 8B single-device configs. With --fit, each is also searched with `--fit` for that
device size (timed the same way). With --set, each is planned with those config overrides, recorded in the result
(``overrides``); results are kept per config and overrides.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT = ["llama3_1/8B_full_single_device", "llama3_1/8B_full_single_device_low_memory",
           "llama3_1/8B_lora_single_device", "llama3_1/8B_qlora_single_device"]

CHILD = """
import resource, sys, time
from mtune._cli.main import main
start = time.perf_counter()
code = main(sys.argv[1:])
print("PLAN_STATS", time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, code)
"""


def recipe_of(config: str) -> str:
    for line in (REPO / "recipes" / "configs" / f"{config}.yaml").read_text().splitlines():
        if line.startswith("recipe:"):
            return line.split(":", 1)[1].strip()
    raise SystemExit(f"{config}: no recipe key")


def ranks_of(config: str) -> int:
    """The number of processes a distributed config's header runs it on (`mtune run --nproc_per_node N`), else 1."""
    text = (REPO / "recipes" / "configs" / f"{config}.yaml").read_text()
    match = re.search(r"mtune run --nproc_per_node (\d+) ", text)
    return int(match.group(1)) if match else 1


def plan_one(config: str, workdir: Path, fit: str | None, overrides: tuple[str, ...] = ()) -> dict:
    family, file = config.split("/")
    size = re.match(r"(.+?)_(full|lora|qlora|dora)(?:_|$)", file).group(1)  # 8B, or 30B_A3B
    recipe, world_size = recipe_of(config), ranks_of(config)
    out = workdir / (config.replace("/", "__") + ".json")
    args = ["plan", "--nproc_per_node", str(world_size), recipe, "--config", config, "device=cuda",
            "model.checkpoint_dir=null", f"model.family={family}", f"model.size={size}", "tokenizer.path=null",
            *overrides, "--json", str(out)]
    if fit:
        args = ["plan", "--fit", "--device-memory", fit, "--output", str(workdir / "fit.yaml"), *args[1:-2]]
    env = {**os.environ, "PYTHONPATH": str(REPO), "MTUNE_QUIET": "1"}
    proc = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, env=env)
    stats = [line for line in proc.stdout.splitlines() if line.startswith("PLAN_STATS")]
    if not stats:
        raise SystemExit(f"{config}: the planner failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    _, seconds, rss, code = stats[-1].split()
    result = {"config": config, **({"overrides": " ".join(overrides)} if overrides else {}),
              "recipe": recipe, "world_size": world_size, "seconds": float(seconds),
              "peak_rss_bytes": int(rss), "exit_code": int(code), "output": proc.stdout.split("PLAN_STATS")[0]}
    if not fit:
        plan = json.loads(out.read_text())
        result.update({k: plan[k] for k in ("device_peak_bytes", "host_peak_bytes", "device_total_bytes", "device",
                                            "host", "at_peak", "batch", "parameters")})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", default=DEFAULT)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "plan_configs.json"))
    parser.add_argument("--fit", default=None, help="also time --fit for this device memory")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every config planned (repeatable)")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for config in args.configs:
            started = time.perf_counter()
            result = plan_one(config, Path(tmp), None, tuple(args.overrides))
            if args.fit:
                result["fit"] = plan_one(config, Path(tmp), args.fit, tuple(args.overrides))
            results.append(result)
            write(args.out, results)  # after each config: a long run can be stopped and still leave its figures
            gib = 1024**3
            print(f"{config}: device {result['device_total_bytes'] / gib:.2f} GiB "
                  f"(allocated {result['device_peak_bytes'] / gib:.2f}), host {result['host_peak_bytes'] / gib:.2f}"
                  f" GiB; planned in {result['seconds']:.1f} s using {result['peak_rss_bytes'] / gib:.2f} GiB"
                  + (f"; --fit {args.fit}: {result['fit']['seconds']:.0f} s" if args.fit else "")
                  + f" ({time.perf_counter() - started:.0f} s with start-up)", flush=True)
    print(f"written {args.out}")


def write(out: str, results: list[dict]) -> None:
    """Write ``results`` into ``out``, keeping the configs planned by earlier runs; each result names the machine
    and date it was planned on."""
    machine = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
               "cpus": os.cpu_count(), "python": platform.python_version(),
               "load_average": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d")}
    earlier = json.loads(Path(out).read_text()) if Path(out).exists() else {"results": []}
    def key(result):
        return result["config"], result.get("overrides", "")

    new = {key(r) for r in results}
    kept = [{"machine": earlier.get("machine"), **r} for r in earlier["results"] if key(r) not in new]
    fresh = [{"machine": machine, **r} for r in results]
    Path(out).write_text(json.dumps({"results": kept + fresh}, indent=2) + "\n")


if __name__ == "__main__":
    main()

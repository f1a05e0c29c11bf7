"""``mtune plan --fit`` answers for shipped configs at a range of device budgets, each in its own process, with the
CPU-seconds it took: ``python benchmarks/fit_answers.py [--host-memory 128GiB] FAMILY/SIZE ...`` (default
``llama3_1/8B``; ``llama3_1/70B`` asks the shipped 70B distributed configs the questions in `DISTRIBUTED`, with
`DISTRIBUTED_HOST` of host memory shared by the ranks). Prints a table and writes
``benchmarks/results/fit_answers.json``; docs/plan.md shows it."""

import json
import os
import platform
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUDGETS = ("80GiB", "48GiB", "24GiB", "16GiB", "12GiB", "8GiB", "6GiB")
METHODS = {"full": "full_single_device", "lora": "lora_single_device", "qlora": "lora_single_device"}
DISTRIBUTED = {"llama3_1/70B": [("lora", "80GiB", 8), ("lora", "24GiB", 8), ("qlora", "48GiB", 2),
                                ("qlora", "24GiB", 8)]}
"""Per model: (method, budget per GPU, ranks on one machine) of its shipped ``*_distributed`` configs."""
DISTRIBUTED_HOST = "512GiB"
"""The host memory of the distributed questions' machine (an 8-GPU server), shared by its ranks."""


def run_plan(options: list[str], recipe: str, config: str, family: str, size: str):
    """``mtune plan OPTIONS RECIPE --config CONFIG`` on random weights of ``family``/``size`` for a CUDA target, in
    its own process: ``(completed process, CPU-seconds, wall seconds)``."""
    cmd = [sys.executable, "-m", "mtune", "plan", *options, recipe, "--config", config, "model.checkpoint_dir=null",
           f"model.family={family}", f"model.size={size}", "tokenizer.path=null", "device=cuda"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return proc, round(cpu_s, 1), round(time.perf_counter() - start, 1)


def fit(model: str, method: str, budget: str, host: str, ranks: int = 1) -> dict:
    family, size = model.split("/")
    where = "single_device" if ranks == 1 else "distributed"
    config = f"{family}/{size}_{method}_{where}"
    out = Path("/tmp") / f"mtune_fit_{family}_{size}_{method}_{budget}_{ranks}.yaml"
    options = ["--fit", "--device-memory", budget, "--host-memory", host, "--output", str(out)]
    recipe = METHODS[method]
    if ranks > 1:
        options += ["--nproc_per_node", str(ranks)]
        recipe = recipe.replace("single_device", "distributed")
    proc, cpu_s, wall_s = run_plan(options, recipe, config, family, size)
    text = proc.stdout
    answer = re.search(r"^answer: (.*)$", text, re.M)
    device = re.search(r"^  device (\S+ \S+) of", text, re.M)
    host_used = re.search(r"host (\S+ \S+) of", text)
    lossy = re.search(r"^  lossy.*gives up (.*)$", text, re.M)
    nothing = re.search(r"^nothing.*$", text, re.M)
    return {"model": model, "method": method, "budget": budget, "host_memory": host, "ranks": ranks,
            "answer": answer.group(1) if answer else None, "device": device.group(1) if device else None,
            "host": host_used.group(1) if host_used and answer else None,
            "gives_up": lossy.group(1) if lossy else None, "nothing_fits": nothing.group(0) if nothing else None,
            "cpu_s": cpu_s, "wall_s": wall_s, "rc": proc.returncode,
            "error": proc.stderr.strip().splitlines()[-1] if proc.returncode not in (0, 1) else None}


def main(argv: list[str]) -> None:
    host = "128GiB"
    if argv[:1] == ["--host-memory"]:
        host, argv = argv[1], argv[2:]
    models = argv or ["llama3_1/8B"]
    rows = []
    out = REPO / "benchmarks" / "results" / "fit_answers.json"
    out.parent.mkdir(exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout
    for model in models:
        questions = DISTRIBUTED.get(model) or [(method, budget, 1) for method in METHODS for budget in BUDGETS]
        for method, budget, ranks in questions:
            row = fit(model, method, budget, DISTRIBUTED_HOST if ranks > 1 else host, ranks)
            rows.append(row)
            print(f"{model:<12} {method:<6} {budget:>6} x{ranks} {row['cpu_s']:>6.1f} CPU-s  "
                  f"{row['device'] or '-':>10}  {row['answer'] or row['nothing_fits'] or row['error']}"
                  + (f"  [lossy: {row['gives_up']}]" if row["gives_up"] else ""), flush=True)
            out.write_text(json.dumps({  # after every row: a long run that stops keeps what it measured
                "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}",
                "commit": commit.strip(), "load_average_end": os.getloadavg(), "rows": rows}, indent=1) + "\n")
    print(f"json: {out}")


if __name__ == "__main__":
    main(sys.argv[1:])

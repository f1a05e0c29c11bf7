"""The three reference choices of a preference run, measured and planned: ``python benchmarks/dpo_references.py``.

1. `tiny/lora_dpo_single_device` and `tiny/full_dpo_single_device` for 10 steps (batch 16 pairs, fp32, CPU) with
   each reference the recipe allows: the losses of steps 1 and 10, the peak of live tensor bytes the run measured
   over its first 3 steps (``peak_tensor_gib``, ``plan_check``), the process's peak RSS (``peak_memory_gib``) and
   `mtune plan`'s prediction for the same config (rows at max_seq_len=64; the run's rows are shorter, so it
   measures less);
2. `mtune plan --fit` on the 8B DPO configs at 24, 48 and 80 GiB (random weights, a CUDA target);
3. `mtune plan` of the 8B DPO configs with each reference choice (and a copy stored in fp8 on one device), a CUDA
   target: the allocator peak plus the CUDA context, per GPU.

Writes ``benchmarks/results/dpo_references.json`` (``--only tiny|tiny_fp8|fit_8b|plan_8b ...`` runs those parts and
keeps the others' earlier results; ``tiny_fp8``: of 1., the exact and the fp8 copy only); docs/memory.md and
docs/plan.md show it."""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "MTUNE_QUIET": "1"}
TINY = {"lora_dpo_single_device": ("adapters_off", "precomputed", "copy", "copy:float8_e4m3fn"),
        "full_dpo_single_device": ("precomputed", "copy")}
"""Each recipe's reference choices; ``copy:DTYPE`` is a copy with ``reference_storage_dtype=DTYPE``."""
PLAN = [("lora_dpo_single_device", "llama3_1/8B_lora_dpo_single_device", "llama3_1",
         ("adapters_off", "precomputed", "copy", "copy:float8_e4m3fn")),
        ("lora_dpo_single_device", "qwen3/8B_lora_dpo_single_device", "qwen3",
         ("adapters_off", "precomputed", "copy", "copy:float8_e4m3fn")),
        ("full_dpo_distributed", "llama3_1/8B_full_dpo_distributed", "llama3_1", ("precomputed", "copy"))]
FIT = [("lora_dpo_single_device", "llama3_1/8B_lora_dpo_single_device", None),
       ("full_dpo_distributed", "llama3_1/8B_full_dpo_distributed", 4)]
BUDGETS = ("24GiB", "48GiB", "80GiB")


def mtune(*args: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "mtune", *args], capture_output=True, text=True, env=ENV)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return out


def tiny_runs(root: Path, rows: list, flush, only: dict = TINY) -> list[dict]:
    for recipe, references in only.items():
        for reference in references:
            out = root / f"{recipe}_{reference.replace(':', '_')}"
            common = [*_reference(reference), "max_steps_per_epoch=10", "log_every_n_steps=1", "dataset_val=null"]
            start = time.perf_counter()
            mtune("run", recipe, "--config", f"tiny/{recipe}", f"output_dir={out}", "plan_check=true", *common)
            seconds = time.perf_counter() - start
            metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            steps = [m for m in metrics if "loss" in m]
            mtune("plan", recipe, "--config", f"tiny/{recipe}", *common, "--json", str(out / "plan.json"))
            plan = json.loads((out / "plan.json").read_text())
            rows.append({"recipe": recipe, "reference": reference, "loss_step_1": steps[0]["loss"],
                         "loss_step_10": steps[9]["loss"], "seconds": round(seconds, 1),
                         "measured_peak_tensor_mib": round(max(m.get("peak_tensor_gib", 0) for m in steps) * 1024, 2),
                         "measured_peak_rss_gib": max(m["peak_memory_gib"] for m in steps),
                         "plan_check": json.loads((out / "results.json").read_text()).get("plan_check"),
                         "planned_peak_mib": round(plan["device_peak_bytes"] / 2**20, 2),
                         "planned_parameters_mib": round(plan["device"]["parameters"] / 2**20, 2),
                         "losses": [s["loss"] for s in steps]})
            print(rows[-1], flush=True)
            flush()
    return rows


def tiny_fp8(root: Path, rows: list, flush) -> list[dict]:
    """The exact and the fp8 reference copy of `tiny/lora_dpo_single_device` alone (part ``tiny_fp8``)."""
    return tiny_runs(root, rows, flush, {"lora_dpo_single_device": ("copy", "copy:float8_e4m3fn")})


def _reference(choice: str) -> list[str]:
    """The overrides of a reference choice: ``copy:float8_e4m3fn`` is a copy stored in fp8."""
    kind, _, storage = choice.partition(":")
    return [f"reference={kind}"] + ([f"reference_storage_dtype={storage}"] if storage else [])


def planned_8b(root: Path, rows: list, flush) -> list[dict]:
    for recipe, config, family, references in PLAN:
        ranks = 4 if "distributed" in recipe else 1
        for reference in references:
            out = root / f"{config.replace('/', '_')}_{reference.replace(':', '_')}.json"
            mtune("plan", "--nproc_per_node", str(ranks), recipe, "--config", config, "model.checkpoint_dir=null",
                  f"model.family={family}", "model.size=8B", "tokenizer.path=null", "device=cuda",
                  *_reference(reference), "--json", str(out))
            plan = json.loads(out.read_text())
            rows.append({"config": config, "ranks": ranks, "reference": reference,
                         "device_peak_gib": round(plan["device_peak_bytes"] / 2**30, 2),
                         "device_total_gib": round(plan["device_total_bytes"] / 2**30, 2),
                         "parameters_gib": round(plan["device"]["parameters"] / 2**30, 2)})
            print(rows[-1], flush=True)
            flush()
    return rows


def fit_answers(root: Path, rows: list, flush) -> list[dict]:
    for recipe, config, ranks in FIT:
        for budget in BUDGETS:
            ranks_opt = ["--nproc_per_node", str(ranks)] if ranks else []
            start = time.perf_counter()
            out = mtune("plan", "--fit", "--device-memory", budget, "--host-memory", "128GiB", *ranks_opt, recipe,
                        "--config", config, "model.checkpoint_dir=null", "model.family=llama3_1", "model.size=8B",
                        "tokenizer.path=null", "device=cuda", "--output", str(root / f"{recipe}_{budget}.yaml"))
            answer = [line for line in out.stdout.splitlines() if line.startswith(("answer:", "no config fits"))]
            device = [line.strip() for line in out.stdout.splitlines() if line.strip().startswith("device ")]
            rows.append({"config": config, "ranks": ranks or 1, "budget": budget,
                         "answer": answer[0] if answer else out.stdout.splitlines()[-1],
                         "device": device[0] if device else None, "seconds": round(time.perf_counter() - start, 1)})
            print(rows[-1], flush=True)
            flush()
    return rows


PARTS = {"tiny": tiny_runs, "tiny_fp8": tiny_fp8, "fit_8b": fit_answers, "plan_8b": planned_8b}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted(PARTS), default=sorted(PARTS))
    args = parser.parse_args()
    path = REPO / "benchmarks" / "results" / "dpo_references.json"
    result = json.loads(path.read_text()) if path.exists() else {}
    result["command"] = "python benchmarks/dpo_references.py"
    machine = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
               "cpus": os.cpu_count(), "load_average": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d")}
    def flush() -> None:  # after each row: a long run stopped early keeps what it measured
        path.write_text(json.dumps(result, indent=1) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        for part in args.only:
            result[part] = []
            result.setdefault("machine", {})[part] = machine
            PARTS[part](Path(tmp), result[part], flush)
    print(f"written to {path}")


if __name__ == "__main__":
    main()

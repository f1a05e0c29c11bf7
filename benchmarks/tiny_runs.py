"""Runs of the built-in tiny model's shipped configs, measured: ``mtune run RECIPE --config tiny/CONFIG`` with its
output in a temporary directory; writes the run's first and last logged loss, its ``results.json`` (the task
evaluation before and after training) and the machine to ``benchmarks/results/tiny_runs/CONFIG.json``.

The figures depend on the CPU (torch picks different float kernels for each): the file records which one ran.

    python benchmarks/tiny_runs.py                                          # the README's first command
    python benchmarks/tiny_runs.py lora_dpo_single_device lora_dpo_single_device
    python benchmarks/tiny_runs.py full_dpo_single_device full_dpo_single_device
"""

import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from mtune.training.observe.peak_flops import cpu_model_name

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> None:
    recipe, config = argv[:2] if argv else ("lora_single_device", "lora_single_device")
    command = ["mtune", "run", recipe, "--config", f"tiny/{config}"]
    with tempfile.TemporaryDirectory() as tmp:
        output_dir = Path(tmp) / config
        start, load_start = time.perf_counter(), os.getloadavg()
        subprocess.run([sys.executable, "-m", *command, f"output_dir={output_dir}"], cwd=REPO, check=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
        wall = time.perf_counter() - start
        rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
        results = json.loads((output_dir / "results.json").read_text())
    losses = [row for row in rows if "loss" in row]
    record = {
        "command": " ".join(command),
        "machine": {"cpu": cpu_model_name(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "load_average_start": load_start, "load_average_end": os.getloadavg()},
        "wall_seconds": wall,
        "first_logged": {"step": losses[0]["step"], "loss": losses[0]["loss"]},
        "last_logged": {"step": losses[-1]["step"], "loss": losses[-1]["loss"]},
        "results": results,
    }
    out = REPO / "benchmarks" / "results" / "tiny_runs" / f"{config}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"json: {out}")


if __name__ == "__main__":
    main(sys.argv[1:])

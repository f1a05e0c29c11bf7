"""What ``oom_recovery`` decides on the tiny LoRA config under a ``device_memory_limit`` below what it needs (CPU: the
byte tracker enforces the limit), against the unconstrained run: the re-plans (their lines), the config the run
ends with, each step's samples (trained tokens) and peak, the final loss, and the wall time.

One device: the unconstrained run (``memory_breakdown``: its peak of live tensor bytes is "what the config needs"),
then runs under 75% and 60% of that peak, and under 4 MiB (below the weights: nothing fits). Two ranks (torchrun,
gloo, 8 rows per rank): the unconstrained run and one under 75% of its largest rank's peak. Writes
``benchmarks/results/oom_recovery_tiny.json`` (machine, date, torch, load)::

    python benchmarks/oom_recovery_tiny.py            # about 5 minutes on a shared 2-core CPU
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from mtune.training.observe.peak_flops import cpu_model_name  # noqa: E402
from tests._helpers.recipes import (TRAIN_CONFIG, read_metrics, train_overrides, write_instruct_data,  # noqa: E402
                                    write_tiny_checkpoint)

GIB, MIB = 2**30, 2**20


def _run(out: Path, checkpoint: Path, data: Path, nproc: int = 1, recipe: str = "lora_single_device",
         **changes) -> dict:
    """``mtune run`` (torchrun with ``nproc`` > 1) in a subprocess: its re-plan and error lines, metrics, config."""
    launcher = ["--nproc_per_node", str(nproc)] if nproc > 1 else []
    env = {**os.environ, "PYTHONPATH": str(REPO), "MTUNE_QUIET": "1"}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "mtune", "run", *launcher, recipe, "--config", str(TRAIN_CONFIG),
                           *train_overrides(out, checkpoint, data, **changes)], capture_output=True, text=True,
                          env=env, timeout=1200)
    seconds = time.perf_counter() - start
    rows = read_metrics(out / "out") if (out / "out" / "metrics.jsonl").exists() else []
    written = out / "out" / "mtune_fit.yaml"
    return {
        "exit_status": done.returncode, "wall_seconds": round(seconds, 1),
        "replans": [line.split("mtune: ", 1)[-1] for line in done.stderr.splitlines() if "oom_recovery:" in line],
        "error": next((line for line in done.stderr.splitlines()[::-1] if line.startswith("error:")), None),
        "steps": [r["step"] for r in rows], "trained_tokens": [r["trained_tokens"] for r in rows],
        "losses": [r["loss"] for r in rows], "peak_bytes": [round(r.get("peak_tensor_gib", 0) * GIB) for r in rows],
        "config_written": written.read_text().splitlines()[0] if written.exists() else None,
        "checkpoints": sorted(p.name for p in (out / "out").glob("step_*")),
    }


def _compare(free: dict, held: dict, limit: int) -> dict:
    return {
        "limit_bytes": limit,
        "same_trained_tokens_every_step": held["trained_tokens"] == free["trained_tokens"],
        "max_peak_over_limit": max(held["peak_bytes"]) / limit if held["peak_bytes"] else None,
        "final_loss_difference": abs(held["losses"][-1] - free["losses"][-1]) if held["losses"] else None,
        "largest_loss_difference": max((abs(a - b) for a, b in zip(held["losses"], free["losses"])), default=None),
    }


def main() -> None:
    results: dict = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}, {cpu_model_name()}",
        "date": time.strftime("%Y-%m-%d", time.gmtime()), "torch": torch.__version__,
        "load_average_before": os.getloadavg(),
        "config": "tests/assets/configs/tiny_train.yaml (tiny llama3_1, 2 blocks, LoRA q/v/o rank 8, fp32, "
                  "4 rows per step, 48 instruction rows)",
    }
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        checkpoint, data = write_tiny_checkpoint(tmp / "ckpt"), write_instruct_data(tmp / "train.jsonl")
        free = _run(tmp / "free", checkpoint, data, max_steps_per_epoch=6, memory_breakdown=True)
        need = max(free["peak_bytes"])
        one = {"unconstrained": free, "needs_bytes": need}
        for share in (0.75, 0.6):
            limit = int(share * need)
            held = _run(tmp / f"held{share}", checkpoint, data, max_steps_per_epoch=6, device_memory_limit=limit)
            one[f"limit_{int(share * 100)}pct"] = {**held, **_compare(free, held, limit)}
            print(f"one device, {share:.0%} of {need / MIB:.2f} MiB: {len(held['replans'])} re-plans, "
                  f"final loss difference {one[f'limit_{int(share * 100)}pct']['final_loss_difference']}")
        one["limit_4MiB"] = _run(tmp / "nothing", checkpoint, data, max_steps_per_epoch=6, device_memory_limit="4MiB")
        results["one_device"] = one
        free2 = _run(tmp / "free2", checkpoint, data, nproc=2, recipe="lora_distributed", max_steps_per_epoch=3,
                     batch_size=8, memory_breakdown=True)
        need2 = max(free2["peak_bytes"])
        limit2 = int(0.75 * need2)
        held2 = _run(tmp / "held2", checkpoint, data, nproc=2, recipe="lora_distributed", max_steps_per_epoch=3,
                     batch_size=8, device_memory_limit=limit2)
        results["two_ranks"] = {"unconstrained": free2, "needs_bytes": need2,
                                "limit_75pct": {**held2, **_compare(free2, held2, limit2)}}
        print(f"two ranks, 75% of {need2 / MIB:.2f} MiB: {len(held2['replans'])} re-plans, final loss difference "
              f"{results['two_ranks']['limit_75pct']['final_loss_difference']}")
        text = json.dumps({**results, "load_average_after": os.getloadavg()}, indent=1) + "\n"
        text = text.replace(str(tmp), "$TMP")  # the run's temporary directory, not a path of this machine
    out = REPO / "benchmarks" / "results" / "oom_recovery_tiny.json"
    out.write_text(text)
    print(f"json: {out}")



if __name__ == "__main__":
    main()

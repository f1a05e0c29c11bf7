"""``mtune plan`` against a real run, on the CPU: for each flag set of ``tests/recipes/test_plan.py``'s matrix
(the tiny Llama 3.1-shaped test model, 2 layers, packed rows of 64 tokens, 2 steps, fp32), the planned peak of live
tensor bytes against the peak the run's tracker measured (``memory_breakdown: true``), and per category. The test
asserts the tolerances; this writes the amounts to ``benchmarks/results/plan_vs_tracker.json``.

    python benchmarks/plan_vs_tracker.py            # every row (a few minutes on 2 quiet cores)
"""

import datetime
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from mtune.training.planning.plan import plan_memory  # noqa: E402
from tests._helpers.recipes import run_recipe_in_process, write_instruct_data, write_tiny_checkpoint  # noqa: E402
from tests.recipes.test_plan import MATRIX, _config, _overrides  # noqa: E402


def main(names: list[str]) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        checkpoint = write_tiny_checkpoint(tmp / "ckpt")
        (tmp / "data").mkdir()
        data = write_instruct_data(tmp / "data" / "train.jsonl")
        for name in names or list(MATRIX):
            recipe, changes = MATRIX[name]
            run_dir = tmp / name
            run_dir.mkdir()
            overrides = _overrides(run_dir, checkpoint, data, changes)
            plan = plan_memory(_config(recipe, overrides))
            measured = json.loads((run_recipe_in_process(recipe, overrides) / "memory_breakdown.json").read_text())
            row = {"name": name, "recipe": recipe, "changes": changes,
                   "planned_device_bytes": plan.device_peak_bytes,
                   "measured_device_bytes": measured["device_peak_bytes"],
                   "device_error": plan.device_peak_bytes / measured["device_peak_bytes"] - 1,
                   "planned": dict(plan.device), "measured": measured["device"]}
            rows.append(row)
            print(f"{name:<32} planned {row['planned_device_bytes']:>12,} measured "
                  f"{row['measured_device_bytes']:>12,} error {row['device_error']:+.4%}", flush=True)
    out = REPO / "benchmarks" / "results" / "plan_vs_tracker.json"
    out.write_text(json.dumps({
        "command": "python benchmarks/plan_vs_tracker.py",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "load_average": os.getloadavg()},
        "rows": rows}, indent=1) + "\n")
    print(f"json: {out}")


if __name__ == "__main__":
    main(sys.argv[1:])

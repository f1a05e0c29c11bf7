"""benchmarks/replan_gpu_rows.py: which measured rows it plans again, and its planned-vs-measured errors on a cheap
one (Llama 3.2 1B eager: about a CPU-second)."""

import json
from pathlib import Path

from tests._helpers.scripts import load_script

REPO = Path(__file__).resolve().parents[2]


replan = load_script("replan_gpu_rows", "benchmarks")


def test_it_replans_the_latest_ok_run_row_of_each_case_on_each_gpu():
    rows = [
        {"case": "a", "gpu_name": "H100", "status": "ok", "kind": "run", "max_allocated_gib": 1.0, "date": "1"},
        {"case": "a", "gpu_name": "H100", "status": "ok", "kind": "run", "max_allocated_gib": 2.0, "date": "2"},
        {"case": "a", "gpu_name": "H200", "status": "ok", "kind": "run", "max_allocated_gib": 3.0, "date": "1"},
        {"case": "b", "gpu_name": "H100", "status": "failed", "kind": "run", "date": "3"},
        {"case": "c", "gpu_name": "H100", "status": "ok", "kind": "head_to_head", "max_allocated_gib": 1.0},
        {"case": "d", "gpu_name": None, "status": "ok", "kind": "run", "max_allocated_gib": None},  # a dry run
    ]
    chosen = replan.latest_run_rows(rows, None)
    assert sorted((r["case"], r["gpu_name"], r["max_allocated_gib"]) for r in chosen) == [("a", "H100", 2.0),
                                                                                           ("a", "H200", 3.0)]
    assert replan.latest_run_rows(rows, ["b", "c"]) == []


def test_a_replanned_row_is_its_config_planned_against_its_measurement(tmp_path):
    (row,) = replan.main(["--cases", "llama3_2_1B_lora_eager", "--out", str(tmp_path / "replan.json")])
    measured = [r for r in json.loads((REPO / "benchmarks" / "results" / "gpu_suite.json").read_text())["rows"]
                if r["case"] == "llama3_2_1B_lora_eager" and r["status"] == "ok"][-1]
    assert row["max_allocated_gib"] == measured["max_allocated_gib"]
    assert row["plan_error_now"] == row["planned_now_gib"] / measured["max_allocated_gib"] - 1
    assert row["plan_error_then"] == measured["planned_allocated_gib"] / measured["max_allocated_gib"] - 1
    assert json.loads((tmp_path / "replan.json").read_text())["rows"] == [row]

"""Plan the GPU suite's measured rows again with this code, on the CPU: the planner's error against what a GPU
measured, without a GPU.

For each case with an ``ok`` row of kind ``run`` in ``benchmarks/results/gpu_suite.json`` (its latest on each GPU),
the case's config is planned as ``gpu_suite.py`` plans it (same overrides, a CUDA target, the NF4 dequantization the
row ran) and the plan is set beside the row's ``max_allocated_gib`` and the plan the row was measured with. A change
to the planner shows here on every row at once; the GPU's figure is still the truth it is checked against.

    python benchmarks/replan_gpu_rows.py [--cases NAME ...] [--out benchmarks/results/replan_gpu_rows.json]

Prints a table and writes JSON (``rows``: case, gpu_name, compile, measured date, max_allocated_gib, the plan then
and its error, the plan now and its error, the plan's notes and CPU seconds).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def latest_run_rows(rows: list[dict], cases: list[str] | None) -> list[dict]:
    """The latest ``ok`` row of kind ``run`` of each case on each GPU (``cases``: only these)."""
    latest = {(r["gpu_name"], r["case"]): r for r in rows
              if r["status"] == "ok" and r.get("kind", "run") == "run" and r.get("gpu_name")
              and r.get("max_allocated_gib") and (not cases or r["case"] in cases)}
    return list(latest.values())


def case_plan_config(case, suite, api):
    """``(config, None)`` to plan ``case`` (a ``gpu_suite.Case``) as its row ran, NF4 dequantized as the row did,
    or ``(None, why not)``."""
    from mtune.modules import nf4_dequantize

    cfg, missing = suite.case_config(api, case, device="cuda", dry_run=False)
    if missing:
        return None, f"keys not in the recipe: {missing}"
    nf4_dequantize.COMPILED_ON_CUDA = not case.torchao_dequantize  # the dequantization the row ran
    return cfg, None


def write_rows(path: Path, rows: list[dict]) -> None:
    """``rows`` as JSON at ``path``, with this machine and the date."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "rows": rows},
        indent=1) + "\n")
    print(f"json: {path}")


def replan(row: dict, case, suite, api) -> dict:
    """``row``'s ``case`` (a ``gpu_suite.Case``) planned now, beside what the GPU measured."""
    cfg, reason = case_plan_config(case, suite, api)
    if cfg is None:
        return {"case": case.name, "status": "skipped", "reason": reason}
    start = time.process_time()
    plan = api.plan_memory(cfg)
    planned = plan.device_peak_bytes / api.GIB
    measured = row["max_allocated_gib"]
    return {"case": case.name, "gpu_name": row["gpu_name"], "compile": case.compile, "measured_date": row["date"],
            "max_allocated_gib": measured, "planned_then_gib": row["planned_allocated_gib"],
            "plan_error_then": row["planned_allocated_gib"] / measured - 1, "planned_now_gib": planned,
            "plan_error_now": planned / measured - 1, "notes": plan.notes,
            "plan_cpu_s": time.process_time() - start, "status": "ok"}


def table(rows: list[dict]) -> str:
    lines = ["| case | compile | max_allocated_gib | planned then | error then | planned now | error now |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['case']} | – | – | – | – | – | {r['status']} |")
            continue
        lines.append(f"| {r['case']} | {r['compile']} | {r['max_allocated_gib']:.2f} | {r['planned_then_gib']:.2f} "
                     f"| {r['plan_error_then']:+.1%} | {r['planned_now_gib']:.2f} | {r['plan_error_now']:+.1%} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", help="only these cases (default: every measured run row)")
    parser.add_argument("--out", type=Path, default=RESULTS / "replan_gpu_rows.json")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE))
    import gpu_suite

    api = gpu_suite.mtune_api()
    measured = latest_run_rows(json.loads((RESULTS / "gpu_suite.json").read_text())["rows"], args.cases)
    cases = {c.name: c for c in gpu_suite.CASES}
    rows = []
    for row in measured:
        rows.append(replan(row, cases[row["case"]], gpu_suite, api))
        print(f"{row['case']}: {rows[-1].get('planned_now_gib', 0):.2f} GiB planned now", flush=True)
    print(table(rows))
    write_rows(args.out, rows)
    return rows


if __name__ == "__main__":
    main()

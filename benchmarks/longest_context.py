"""``mtune plan --fit --maximize seq_len`` on shipped configs: the longest packed row each fits at a range of device
budgets, each question in its own process, with the CPU-seconds it took.

    python benchmarks/longest_context.py [--host-memory 128GiB] [--budgets 80GiB,48GiB,24GiB] [FAMILY/SIZE/METHOD ...]

Default: Llama 3.1 8B LoRA and QLoRA at 80, 48 and 24 GiB, random weights (nothing is downloaded), a CUDA target.
Prints a table and writes ``benchmarks/results/longest_context.json``; docs/plan.md shows it."""

import json
import os
import platform
import re
import sys
import time
from pathlib import Path

from fit_answers import run_plan  # benchmarks/, the script's own folder

REPO = Path(__file__).resolve().parents[1]
RECIPES = {"full": "full_single_device", "lora": "lora_single_device", "qlora": "lora_single_device"}


def longest(family: str, size: str, method: str, budget: str, host: str) -> dict:
    config = f"{family}/{size}_{method}_single_device"
    out = Path("/tmp") / f"mtune_longest_{family}_{size}_{method}_{budget}.yaml"
    proc, cpu_s, wall_s = run_plan(["--fit", "--maximize", "seq_len", "--device-memory", budget, "--host-memory",
                                    host, "--output", str(out)], RECIPES[method], config, family, size)
    text = proc.stdout
    tokens = re.search(r"^answer: ([\d,]+) tokens per row", text, re.M)
    techniques = re.search(r"^  with (.*)$", text, re.M)
    device = re.search(r"^  device (\S+ \S+) of", text, re.M)
    host_used = re.search(r"\), host (\S+ \S+) of", text)
    limit = re.search(r"^  (limited by .*|stopped at .*?tokens)", text, re.M)
    return {"model": f"{family}/{size}", "method": method, "budget": budget, "host_memory": host,
            "seq_len": int(tokens.group(1).replace(",", "")) if tokens else None,
            "techniques": techniques.group(1) if techniques else None,
            "device": device.group(1) if device else None, "host": host_used.group(1) if host_used else None,
            "limit": limit.group(1) if limit else None,
            "cpu_s": cpu_s, "wall_s": wall_s, "rc": proc.returncode,
            "output": text.strip().splitlines()[-12:] if proc.returncode else None,
            "error": proc.stderr.strip().splitlines()[-1] if proc.returncode not in (0, 1) else None}


def main(argv: list[str]) -> None:
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return
    host, budgets = "128GiB", ["80GiB", "48GiB", "24GiB"]
    while argv[:1] in (["--host-memory"], ["--budgets"]):
        if argv[0] == "--host-memory":
            host = argv[1]
        else:
            budgets = argv[1].split(",")
        argv = argv[2:]
    questions = argv or ["llama3_1/8B/lora", "llama3_1/8B/qlora"]
    out = REPO / "benchmarks" / "results" / "longest_context.json"
    rows = []
    print(f"{'model':<12} {'method':<6} {'budget':>6} {'longest':>9} {'device':>10} {'host':>10} {'CPU-s':>6}  "
          "techniques")
    for question in questions:
        family, size, method = question.split("/")
        for budget in budgets:
            row = longest(family, size, method, budget, host)
            rows.append(row)
            print(f"{row['model']:<12} {method:<6} {budget:>6} {row['seq_len'] or '-':>9} {row['device'] or '-':>10} "
                  f"{row['host'] or '-':>10} {row['cpu_s']:>6.1f}  {row['techniques'] or row['error'] or ''}",
                  flush=True)
            out.write_text(json.dumps({"machine": f"{platform.machine()}, {os.cpu_count()} cores",
                                       "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=2) + "\n")
    print(f"json: {out}")


if __name__ == "__main__":
    main(sys.argv[1:])

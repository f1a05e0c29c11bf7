"""``mtune plan --fit`` for the 2026 families at 24 and 80 GiB (issue 33: Qwen3.5 9B LoRA, Qwen3.5 35B-A3B QLoRA,
Gemma 4 31B QLoRA, gpt-oss 20B LoRA), each from its named size (no download), a CUDA target, with the stated
23 GiB host of this project's machine, each in its own process with its CPU-seconds.

``python benchmarks/fit_2026_families.py [--only CONFIG] [--tag T]`` prints a table and writes
``benchmarks/results/fit_2026_families_<date>[_T].json`` (machine, commit, load average, and per question the
command, answer, device and host figures, CPU-s and wall-s) after every row."""

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fit_host_answers import HOST, REPO, _total_memory, ask_config  # noqa: E402

CONFIGS = ["qwen3_5/9B_lora_single_device", "qwen3_5/35B_A3B_qlora_single_device", "gemma4/31B_qlora_single_device",
           "gpt_oss/20B_lora_single_device"]
BUDGETS = ("24GiB", "80GiB")
NAMED_SIZE = ["device=cuda"]  # the configs' checkpoint_dir is absent here: the model comes from its named size


def table(rows: list[dict]) -> str:
    lines = ["| config | device budget | answer | device | host | CPU-s |", "|---|---|---|---:|---:|---:|"]
    for r in rows:
        answer = r["answer"] or r["nothing_fits"] or r["error"]
        if r["host_that_fits"]:
            answer += f" (lossless with --host-memory {r['host_that_fits']['host_memory']})"
        lines.append(f"| `{r['config']}` | {r['device_memory']} | {answer} | {r['device'] or '—'} | "
                     f"{r['host'] or '—'} | {r['cpu_s']} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    configs = [argv[argv.index("--only") + 1]] if "--only" in argv else CONFIGS
    tag = argv[argv.index("--tag") + 1] if "--tag" in argv else ""
    date = datetime.date.today().isoformat()
    out = REPO / "benchmarks" / "results" / f"fit_2026_families_{date}{'_' + tag if tag else ''}.json"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout
    rows: list[dict] = []
    for config in configs:
        for budget in BUDGETS:
            row = {"config": config, **ask_config("lora_single_device", config, NAMED_SIZE, budget, HOST, False)}
            rows.append(row)
            print(f"{config} {budget}: {row['cpu_s']} CPU-s  {row['answer'] or row['nothing_fits'] or row['error']}"
                  f"  device {row['device']} host {row['host']}", flush=True)
            out.write_text(json.dumps({
                "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}, "
                           f"{_total_memory()} total memory", "date": date, "commit": commit.strip(),
                "cpu_s": "user + system CPU-seconds of the whole command (process start included), os.wait4",
                "load_average_end": os.getloadavg(), "rows": rows}, indent=1) + "\n")
    print(table(rows))
    print(f"json: {out}")


if __name__ == "__main__":
    main(sys.argv[1:])

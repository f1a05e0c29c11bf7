"""Issue 35's questions of ``mtune plan --fit`` under a stated host, each in its own process, with its CPU-seconds:
Llama 3.1 8B (random weights, a CUDA target, the shipped configs) LoRA ``--maximize seq_len`` at 80 GiB on hosts of
12-64 GiB (a larger host never gives a shorter answer), QLoRA ``--maximize`` at 24 GiB (unsloth publishes 78,475
tokens for an 8B QLoRA on a 24 GB card), the full fine-tune at 24 GiB (nothing lossless fits a 23 GiB host: which
host would), and with ``--all`` every canonical 8B question (full, LoRA, QLoRA at 6-80 GiB, and ``--maximize`` at
24-80 GiB). Every answer's host share is checked against its budget.

``python benchmarks/fit_host_answers.py [--all] [--jobs N]`` prints a table and writes
``benchmarks/results/fit_answers_<date>.json`` (machine, commit, and per question the command, answer, device and
host figures, CPU-s and wall-s) after every row."""

import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HOST = "23GiB"
"""The host the issue measured on (this project's machine), stated so that anyone can repeat the answers."""
CONFIGS = {"full": ("full_single_device", "llama3_1/8B_full_single_device"),
           "lora": ("lora_single_device", "llama3_1/8B_lora_single_device"),
           "qlora": ("lora_single_device", "llama3_1/8B_qlora_single_device")}
RANDOM_8B = ["model.checkpoint_dir=null", "model.family=llama3_1", "model.size=8B", "tokenizer.path=null",
             "device=cuda"]

DONE_WHEN = [  # (method, device budget, host, maximize)
    ("lora", "80GiB", "23GiB", True),
    ("lora", "80GiB", "12GiB", True),
    ("lora", "80GiB", "16GiB", True),
    ("lora", "80GiB", "32GiB", True),
    ("lora", "80GiB", "64GiB", True),
    ("qlora", "24GiB", "23GiB", True),
    ("full", "24GiB", "23GiB", False),
]
CANONICAL = ([(m, b, HOST, False) for m in CONFIGS for b in ("80GiB", "48GiB", "24GiB", "16GiB", "12GiB", "8GiB",
                                                               "6GiB")]
             + [(m, b, HOST, True) for m in ("lora", "qlora") for b in ("80GiB", "48GiB", "24GiB")])


def _bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * {"B": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30}[unit]


def ask(method: str, budget: str, host: str, maximize: bool) -> dict:
    """One question in its own process: the parsed answer, and the child's CPU-seconds (os.wait4's rusage)."""
    recipe, config = CONFIGS[method]
    out = Path("/tmp") / f"mtune_fit_host_{method}_{budget}_{host}_{int(maximize)}.yaml"
    options = ["--fit", *(["--maximize", "seq_len"] if maximize else []), "--device-memory", budget,
               "--host-memory", host, "--output", str(out)]
    cmd = [sys.executable, "-m", "mtune", "plan", *options, recipe, "--config", config, *RANDOM_8B]
    log = Path("/tmp") / (out.stem + ".txt")
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    text = log.read_text()
    answer = re.search(r"^answer: (.*)$", text, re.M)
    tokens = re.search(r"^answer: ([\d,]+) tokens per row", text, re.M)
    techniques = re.search(r"^  with (.*)$", text, re.M)
    figures = re.search(r"^  device (\S+ \S+) of .*?host (\S+ \S+) of (\S+ \S+)", text, re.M)
    hint = re.search(r"fits with --host-memory (\d+)GiB or more \(its plan's host share ([^)]*)\): (.*)$", text, re.M)
    nothing = re.search(r"^nothing.*$", text, re.M)
    row = {"method": method, "device_memory": budget, "host_memory": host, "maximize": maximize,
           "command": "mtune plan " + " ".join(options[:-2]) + f" {recipe} --config {config} " + " ".join(RANDOM_8B),
           "answer": (techniques.group(1) if tokens and techniques else answer.group(1)) if answer else None,
           "seq_len": int(tokens.group(1).replace(",", "")) if tokens else None,
           "device": figures.group(1) if figures else None, "host": figures.group(2) if figures else None,
           "host_within_budget": (_bytes(figures.group(2)) <= _bytes(figures.group(3))) if figures else None,
           "host_that_fits": ({"host_memory": f"{hint.group(1)}GiB", "its_host_share": hint.group(2),
                               "answer": hint.group(3)} if hint else None),
           "nothing_fits": nothing.group(0) if nothing else None,
           "cpu_s": round(usage.ru_utime + usage.ru_stime, 1), "wall_s": round(time.perf_counter() - start, 1),
           "rc": proc.returncode,
           "error": text.strip().splitlines()[-1] if proc.returncode not in (0, 1) and text.strip() else None}
    return row


def main(argv: list[str]) -> None:
    questions = DONE_WHEN + (CANONICAL if "--all" in argv else [])
    jobs = int(argv[argv.index("--jobs") + 1]) if "--jobs" in argv else 1
    date = datetime.date.today().isoformat()
    out = REPO / "benchmarks" / "results" / f"fit_answers_{date}.json"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout
    rows: list[dict] = []

    def record(row: dict) -> None:
        rows.append(row)
        print(f"{row['method']:<6}{row['device_memory']:>6} host {row['host_memory']:>6}"
              f"{' --maximize' if row['maximize'] else '           '} {row['cpu_s']:>6.1f} CPU-s  "
              f"{(format(row['seq_len'], ',') + ' tokens') if row['seq_len'] else ''} "
              f"{row['answer'] or row['nothing_fits'] or row['error']}  device {row['device']} host {row['host']}"
              + (f"  [host {row['host_that_fits']['host_memory']} fits: {row['host_that_fits']['answer']}]"
                 if row["host_that_fits"] else ""), flush=True)
        out.write_text(json.dumps({  # after every row: a long run that stops keeps what it measured
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}, "
                       f"{_total_memory()} total memory", "date": date, "commit": commit.strip(),
            "cpu_s": "user + system CPU-seconds of the whole command (process start included), os.wait4",
            "load_average_end": os.getloadavg(), "rows": rows}, indent=1) + "\n")

    with ThreadPoolExecutor(jobs) as pool:
        for row in pool.map(lambda q: ask(*q), questions):
            record(row)
    print(f"json: {out}")


def _total_memory() -> str:
    with open("/proc/meminfo") as f:
        kib = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
    return f"{kib / 2 ** 20:.1f} GiB"


if __name__ == "__main__":
    main(sys.argv[1:])

"""Issue 35's questions of ``mtune plan --fit`` under a stated host, each in its own process, with its CPU-seconds:
Llama 3.1 8B (random weights, a CUDA target, the shipped configs) LoRA ``--maximize seq_len`` at 80 GiB on hosts of
12-64 GiB (a larger host never gives a shorter answer), QLoRA ``--maximize`` at 24 GiB (unsloth publishes 78,475
tokens for an 8B QLoRA on a 24 GB card), the full fine-tune at 24 GiB (nothing lossless fits a 23 GiB host: which
host would), and with ``--all`` every canonical 8B question (full, LoRA, QLoRA at 6-80 GiB, and ``--maximize`` at
24-80 GiB). Every answer's host share is checked against its budget.

``python benchmarks/fit_host_answers.py [--all] [--only fit|maximize] [--first N] [--jobs N] [--tag T]`` prints a table and writes
``benchmarks/results/fit_answers_<date>[_T].json`` (machine, commit, and per question the command, answer, device and
host figures, CPU-s and wall-s) after every row. ``--compare BEFORE.json AFTER.json`` prints, per question in both,
whether the answer is the same and the CPU-s of each (a change meant to make the search faster, not different)."""

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
    ("qlora", "24GiB", "23GiB", True),
    ("full", "24GiB", "23GiB", False),
    ("lora", "80GiB", "12GiB", True),
    ("lora", "80GiB", "16GiB", True),
    ("lora", "80GiB", "32GiB", True),
    ("lora", "80GiB", "64GiB", True),
]
CANONICAL = ([(m, b, HOST, False) for m in CONFIGS for b in ("80GiB", "40GiB", "24GiB", "16GiB", "12GiB", "8GiB",
                                                               "6GiB")]
             + [(m, b, HOST, True) for m in ("lora", "qlora") for b in ("80GiB", "40GiB", "24GiB")])
"""Every canonical 8B question (issue 35: each under 60 CPU-s): ``--fit`` for full, LoRA and QLoRA at 6-80 GiB and
``--maximize seq_len`` for LoRA and QLoRA at 24-80 GiB, all with the stated 23 GiB host."""


def _bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * {"B": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30}[unit]


def ask(method: str, budget: str, host: str, maximize: bool) -> dict:
    """One question of Llama 3.1 8B (``method``: full, lora or qlora) in its own process (:func:`ask_config`)."""
    recipe, config = CONFIGS[method]
    return {"method": method, **ask_config(recipe, config, RANDOM_8B, budget, host, maximize)}


def ask_config(recipe: str, config: str, overrides: list[str], budget: str, host: str, maximize: bool) -> dict:
    """``mtune plan --fit`` of one config in its own process: the parsed answer, and the child's CPU-seconds
    (os.wait4's rusage)."""
    logs = Path("/tmp") / f"mtune_fit_host_{os.getpid()}"  # apart from another run's logs
    logs.mkdir(exist_ok=True)
    out = logs / f"{config.replace('/', '_')}_{budget}_{host}_{int(maximize)}.yaml"
    options = ["--fit", *(["--maximize", "seq_len"] if maximize else []), "--device-memory", budget,
               "--host-memory", host, "--output", str(out)]
    cmd = [sys.executable, "-m", "mtune", "plan", *options, recipe, "--config", config, *overrides]
    log = logs / (out.stem + ".txt")
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
    row = {"device_memory": budget, "host_memory": host, "maximize": maximize,
           "command": "mtune plan " + " ".join(options[:-2]) + f" {recipe} --config {config} " + " ".join(overrides),
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


ANSWER_FIELDS = ("answer", "seq_len", "device", "host", "host_that_fits", "nothing_fits", "rc")
"""What must not change when only the search's speed does."""


def compare(before: Path, after: Path) -> str:
    """A markdown table of the questions in both files: the answer, whether every field of it is the same
    (`ANSWER_FIELDS`), and the CPU-s of each."""
    old = {(r["method"], r["device_memory"], r["host_memory"], r["maximize"]): r
           for r in json.loads(before.read_text())["rows"]}
    lines = ["| question | answer | same answer | CPU-s before | CPU-s after |", "|---|---|---|---:|---:|"]
    for r in json.loads(after.read_text())["rows"]:
        b = old.get((r["method"], r["device_memory"], r["host_memory"], r["maximize"]))
        if b is None:
            continue
        same = all(b[k] == r[k] for k in ANSWER_FIELDS)
        what = (f"{r['method']} {'`--maximize` ' if r['maximize'] else ''}at {r['device_memory']}, host "
                f"{r['host_memory']}")
        answer = (f"{r['seq_len']:,} tokens" if r["seq_len"] else
                  "nothing fits" + (f", fits with --host-memory {r['host_that_fits']['host_memory']}"
                                    if r["host_that_fits"] else "") if r["nothing_fits"] else
                  f"device {r['device']}, host {r['host']}")
        lines.append(f"| {what} | {answer} | {'yes' if same else 'NO'} | {b['cpu_s']} | {r['cpu_s']} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if "--compare" in argv:  # --compare BEFORE.json AFTER.json
        i = argv.index("--compare")
        print(compare(Path(argv[i + 1]), Path(argv[i + 2])))
        return
    questions = DONE_WHEN + ([q for q in CANONICAL if q not in DONE_WHEN] if "--all" in argv else [])
    if "--only" in argv:  # a subset: "--only fit" (the --fit questions) or "--only maximize"
        maximize = argv[argv.index("--only") + 1] == "maximize"
        questions = [q for q in questions if q[3] == maximize]
    if "--first" in argv:  # the first N of them (a machine too busy for all)
        questions = questions[:int(argv[argv.index("--first") + 1])]
    jobs = int(argv[argv.index("--jobs") + 1]) if "--jobs" in argv else 1
    date = datetime.date.today().isoformat()
    tag = argv[argv.index("--tag") + 1] if "--tag" in argv else ""
    out = REPO / "benchmarks" / "results" / f"fit_answers_{date}{'_' + tag if tag else ''}.json"
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
    print(table(rows))
    print(f"json: {out}")


def table(rows: list[dict]) -> str:
    """The rows as a markdown table: question, answer, device, host, CPU-s."""
    lines = ["| question | answer | device | host | CPU-s |", "|---|---|---:|---:|---:|"]
    for r in rows:
        what = (f"{r['method']} {'`--maximize` ' if r['maximize'] else ''}at {r['device_memory']}, host "
                f"{r['host_memory']}")
        answer = (f"{r['seq_len']:,} tokens: {r['answer']}" if r["seq_len"] else r["answer"] or r["nothing_fits"]
                  or r["error"])
        if r["host_that_fits"]:
            answer += f" (fits with --host-memory {r['host_that_fits']['host_memory']})"
        lines.append(f"| {what} | {answer} | {r['device'] or '—'} | {r['host'] or '—'} | {r['cpu_s']} |")
    return "\n".join(lines)


def _total_memory() -> str:
    with open("/proc/meminfo") as f:
        kib = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
    return f"{kib / 2 ** 20:.1f} GiB"


if __name__ == "__main__":
    main(sys.argv[1:])

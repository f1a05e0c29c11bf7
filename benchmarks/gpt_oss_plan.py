"""What planning gpt-oss costs and what its attention sinks add to a plan.

1. ``mtune plan`` and ``mtune plan --fit --device-memory 24GiB --host-memory 23GiB`` on
   ``gpt_oss/20B_lora_single_device`` (CUDA target, the 20B from its named size: no download), each in its own
   process: CPU seconds (user + system, as ``/usr/bin/time`` counts them), wall seconds, peak RSS, and the answer's
   last lines.
2. The same config planned in-process with the sinks and without them (the attention run as plain GQA): the planned
   peak and its activations and temporaries, so the sinks' cost in a plan is a measured difference.

    python benchmarks/gpt_oss_plan.py [--out benchmarks/results/gpt_oss_plan_timing.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = "gpt_oss/20B_lora_single_device"
COMMANDS = {
    "plan": ["plan", "lora_single_device", "--config", CONFIG, "device=cuda"],
    "fit_24GiB": ["plan", "--fit", "--device-memory", "24GiB", "--host-memory", "23GiB", "--output", "{tmp}",
                  "lora_single_device", "--config", CONFIG, "device=cuda"],
}


def timed(argv: list[str]) -> dict:
    """One ``python -m mtune`` process: its CPU seconds (from the children's rusage), wall seconds, peak RSS."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "mtune", *argv], capture_output=True, text=True, env=env, cwd=REPO)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode:
        raise SystemExit(f"mtune {' '.join(argv)} failed:\n{out.stderr[-3000:]}")
    return {"command": "mtune " + " ".join(argv), "cpu_seconds": round(after.ru_utime + after.ru_stime
                                                                      - before.ru_utime - before.ru_stime, 1),
            "wall_seconds": round(wall, 1), "peak_rss_bytes": after.ru_maxrss * 1024,
            "answer_tail": out.stdout.strip().splitlines()[-12:]}


def sinks_in_plan() -> dict:
    """The config's plan with the sinks and with the attention run as plain GQA (sinks=None)."""
    sys.path.insert(0, str(REPO))
    from mtune._cli.catalog import find_config, find_recipe, load_recipe_module
    from mtune._cli.run import load_and_check
    from mtune.modules import sink_attention
    from mtune.modules.attention import causal_attention
    from mtune.modules.rotary import apply_rotary
    from mtune.training.planning.plan import plan_memory

    overrides = ["device=cuda", "model.checkpoint_dir=null", "model.family=gpt_oss", "model.size=20B",
                 "tokenizer.path=null"]
    module = load_recipe_module(find_recipe("lora_single_device"))

    def plan() -> dict:
        p = plan_memory(load_and_check(module, find_config(CONFIG), overrides))
        return {"device_peak_bytes": p.device_peak_bytes, "activations": p.device["activations"],
                "temporaries": p.device["temporaries"]}

    with_sinks = plan()
    original = sink_attention.SinkAttention.attend

    def without(self, q, k, v, cos, sin, mask=None, cache_pos=None, segments=None):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return causal_attention(q, k, v, mask, segments, self.sliding_window, None)

    sink_attention.SinkAttention.attend = without
    try:
        no_sinks = plan()
    finally:
        sink_attention.SinkAttention.attend = original
    return {"with_sinks": with_sinks, "without_sinks": no_sinks,
            "sinks_add_bytes": with_sinks["device_peak_bytes"] - no_sinks["device_peak_bytes"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gpt_oss_plan_timing.json"))
    args = parser.parse_args()
    import tempfile

    from mtune.training.observe.peak_flops import cpu_model_name

    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: timed([a.format(tmp=f"{tmp}/fit.yaml") for a in argv]) for name, argv in COMMANDS.items()}
    result = {"meta": {"date": datetime.date.today().isoformat(), "machine": cpu_model_name(),
                       "cpus": os.cpu_count(), "python": platform.python_version(),
                       "note": "a 2-core box shared with other sessions: CPU seconds, not wall, are the figure"},
              "config": CONFIG, "runs": runs, "sinks": sinks_in_plan()}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for name, run in runs.items():
        print(f"{name}: {run['cpu_seconds']} CPU-s, {run['wall_seconds']} s wall, "
              f"{run['peak_rss_bytes'] / 2**30:.2f} GiB RSS")
    print(json.dumps(result["sinks"]))


if __name__ == "__main__":
    main()

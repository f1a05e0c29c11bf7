"""What each long-context technique does to the activation term: the tiny LoRA config (tiny/lora_single_device:
4 layers, width 256, LoRA on every linear), packed rows, batch 1, at several row lengths.

Each row adds one technique to the one above: the dense-mask fallback, then the segments kernel (document
boundaries, SDPA per document), the tiled MLP (``mlp_tiles=auto``), block checkpointing, offloaded block inputs,
the chunked loss. Each cell runs the planner's two training steps on real tensors on this CPU
(``plan_memory(cfg, fake=False)``: the run's own setup and step, the run's byte tracker) with a CUDA-like target
(``device=cuda``: device and host told apart, so offloaded block inputs count on the host, storages rounded to
512 bytes); the fake-tensor plan of the same config is printed beside it. Prints a table (device peak of live
tensor bytes, GiB) and writes JSON.

    python benchmarks/long_context.py [--lengths 4096 8192 16384] [--out benchmarks/results/long_context.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from mtune._cli.catalog import find_recipe, load_recipe_module  # noqa: E402
from mtune._cli.run import load_and_check  # noqa: E402
from mtune.training.planning.plan import plan_memory  # noqa: E402
from mtune.units import GIB  # noqa: E402

CONFIG = REPO / "recipes" / "configs" / "tiny" / "lora_single_device.yaml"
ROWS = [
    ("dense mask", {"attention_kernel": "dense_mask"}),
    ("segments", {"attention_kernel": "segments"}),
    ("+ tiled MLP", {"mlp_tiles": "auto"}),
    ("+ checkpointing", {"enable_activation_checkpointing": True}),
    ("+ offloaded block inputs", {"enable_activation_offloading": True, "activation_offloading_use_streams": False}),
    ("+ chunked loss", {"loss._component_": "mtune.modules.loss.ChunkedCrossEntropyLoss"}),
]


def _cfg(module, seq_len: int, changes: dict):
    overrides = {"device": "cuda", "dataset.packed": True, "batch_size": 1, "tokenizer.max_seq_len": seq_len,
                 "plan_check": False, "output_dir": "/tmp/mtune_bench_long_context", **changes}
    text = [f"{k}={'true' if v is True else 'false' if v is False else v}" for k, v in overrides.items()]
    return load_and_check(module, CONFIG, text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "long_context.json"))
    args = parser.parse_args()
    logging.getLogger("mtune").setLevel(logging.WARNING)
    module = load_recipe_module(find_recipe("lora_single_device"))
    results, changes = [], {}
    print(f"{'technique (cumulative)':<26}" + "".join(f"{s:>23}" for s in args.lengths))
    print(f"{'':<26}" + "".join(f"{'measured / planned GiB':>23}" for _ in args.lengths))
    for name, delta in ROWS:
        changes = {**changes, **delta}
        cells = []
        for seq_len in args.lengths:
            cfg = _cfg(module, seq_len, changes)
            start = time.perf_counter()
            measured = plan_memory(cfg, fake=False)
            seconds = time.perf_counter() - start
            planned = plan_memory(cfg)
            cells.append({"seq_len": seq_len, "measured_device_bytes": measured.device_peak_bytes,
                          "measured_host_bytes": measured.host_peak_bytes,
                          "measured_activation_bytes": measured.device["activations"],
                          "planned_device_bytes": planned.device_peak_bytes, "two_steps_seconds": seconds})
        results.append({"row": name, "overrides": dict(changes), "cells": cells})
        print(f"{name:<26}" + "".join(f"{c['measured_device_bytes'] / GIB:>15.3f} / {c['planned_device_bytes'] / GIB:.3f}"
                                      for c in cells), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "config": "tiny/lora_single_device, dataset.packed=true, batch_size=1, device=cuda target on CPU tensors",
        "torch": torch.__version__, "machine": platform.machine(), "date": time.strftime("%Y-%m-%d"),
        "rows": results}, indent=2) + "\n")
    print(f"json: {args.out}")


if __name__ == "__main__":
    main()

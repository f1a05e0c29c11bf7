"""The scan over chunks of Qwen3.5's Gated DeltaNet rule: `mtune.modules.gated_delta_scan` (one autograd function,
its own backward, buffers allocated once) against the per-chunk autograd loop it replaced (written out below as it
was), on the same inputs.

Three measures, each row one implementation at one length:

- ``fwd_bwd_s``: wall seconds of ``chunked_gated_delta_rule`` forward and backward (fp32, one row, 16 value heads of
  128 x 128, Qwen3.5 9B's), the median of 3 after one warm-up;
- ``plan_cpu_s``: CPU seconds of one ``mtune plan`` of ``qwen3_5/9B_lora_single_device`` (named size, CUDA target,
  packed rows of ``seq_len``, planned with 4 blocks), which traces every chunk on fake tensors in the loop's form;
- ``plan_peak_bytes``: that plan's device peak.

    python benchmarks/deltanet_scan.py [--out benchmarks/results/deltanet_scan.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mtune.modules import gated_deltanet  # noqa: E402

LENGTHS = {"fwd_bwd": (4096, 16384), "plan": (8192, 32768)}


def autograd_loop(u, w, q, scores, k_end, decay, initial=None):
    """The scan as it was before gated_delta_scan: a loop of batched matmuls that autograd differentiates, keeping
    each chunk's state and writes for backward (inputs and outputs as `gated_delta_scan`'s)."""
    bh, n, _, dv = u.shape
    state = u.new_zeros(bh, w.shape[-1], dv) if initial is None else initial
    outputs = []
    for u_c, w_c, q_c, scores_c, k_end_c, decay_c in zip(*(t.unbind(1) for t in (u, w, q, scores, k_end, decay))):
        delta = torch.baddbmm(u_c, w_c, state, alpha=-1)
        outputs.append(torch.baddbmm(scores_c @ delta, q_c, state))
        state = torch.baddbmm(state * decay_c, k_end_c, delta)
    return torch.stack(outputs, dim=1), state


@contextmanager
def scan(name: str):
    """``chunked_gated_delta_rule`` with the named scan."""
    original = gated_deltanet.gated_delta_scan
    if name == "autograd loop":
        gated_deltanet.gated_delta_scan = autograd_loop
    try:
        yield
    finally:
        gated_deltanet.gated_delta_scan = original


def fwd_bwd_seconds(seq_len: int) -> float:
    gen = torch.Generator().manual_seed(0)
    b, h, dk, dv = 1, 16, 128, 128
    q = torch.nn.functional.normalize(torch.randn(b, h, seq_len, dk, generator=gen), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(b, h, seq_len, dk, generator=gen), dim=-1)
    v = torch.randn(b, h, seq_len, dv, generator=gen)
    g, beta = -torch.rand(b, h, seq_len, generator=gen) * 0.5, torch.rand(b, h, seq_len, generator=gen)
    inputs = [t.requires_grad_() for t in (q, k, v, g, beta)]
    times = []
    for rep in range(4):
        start = time.perf_counter()
        gated_deltanet.chunked_gated_delta_rule(*inputs).sum().backward()
        if rep:  # the first is the warm-up
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def plan_once(seq_len: int) -> tuple[float, int]:
    from mtune._cli.catalog import find_config, find_recipe, load_recipe_module
    from mtune._cli.plan import plan_without_download
    from mtune._cli.run import load_and_check
    from mtune.training.planning.cost import one_search
    from mtune.training.planning.plan import plan_memory

    config = find_config("qwen3_5/9B_lora_single_device")
    cfg = load_and_check(load_recipe_module(find_recipe("lora_single_device")), config,
                         ["device=cuda", "dataset.packed=true", "batch_size=1", f"tokenizer.max_seq_len={seq_len}"])
    plan_without_download(cfg, Path(config))
    with one_search():
        start = time.process_time()
        plan = plan_memory(cfg, n_layers=4)
        return time.process_time() - start, plan.device_peak_bytes


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "deltanet_scan.json"))
    args = parser.parse_args(argv)
    rows = []
    for name in ("autograd loop", "gated_delta_scan"):
        with scan(name):
            for seq_len in LENGTHS["fwd_bwd"]:
                rows.append({"impl": name, "seq_len": seq_len, "fwd_bwd_s": round(fwd_bwd_seconds(seq_len), 3)})
            for seq_len in LENGTHS["plan"]:
                seconds, peak = plan_once(seq_len)
                rows.append({"impl": name, "seq_len": seq_len, "plan_cpu_s": round(seconds, 2),
                             "plan_peak_bytes": peak})
    print(f"{'implementation':<18} {'tokens':>7} {'fwd+bwd s':>10} {'plan CPU-s':>11} {'plan peak GiB':>14}")
    for row in rows:
        print(f"{row['impl']:<18} {row['seq_len']:>7,} {row.get('fwd_bwd_s', ''):>10} {row.get('plan_cpu_s', ''):>11} "
              + (f"{row['plan_peak_bytes'] / 2**30:>14.3f}" if "plan_peak_bytes" in row else ""))
    result = {"machine": f"{platform.machine()}, {torch.get_num_threads()} threads, {platform.system()}",
              "date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "fwd_bwd": "chunked_gated_delta_rule forward + backward, fp32, 1 x 16 heads x 128 x 128, median of 3",
              "plan": "mtune plan lora_single_device qwen3_5/9B_lora_single_device (named size, device=cuda, packed, "
                      "batch_size=1), 4 blocks, CPU seconds", "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])

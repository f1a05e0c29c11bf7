"""Where the planner's constants come from (``mtune.training.planning``): what this CPU can measure, measured; the
rest cited, waiting for a lent GPU (the GPU issue). Prints a table and writes
``benchmarks/results/planner_constants.json`` (machine, date, torch, load). ``python benchmarks/planner_constants.py``
(about a minute on 2 cores).

Measured here:
- the kernels (aten ops) one transformer block dispatches in forward and backward, counted on a llama3_1-shaped block
  (the count does not depend on the machine, only on the model code): the first factor of
  ``MICRO_BATCH_OVERHEAD_S``'s stated ``blocks x kernels x launch cost``;
- the fixed cost of a micro-batch on this CPU: the intercept of forward+backward time against the micro-batch's
  tokens (a least-squares line over a few sizes, best of several calls each). A CPU figure, not the GPU's: it shows
  the method the GPU suite will use, and that the fixed cost is not zero.

Cited (GPU-only; see benchmarks/results/README.md): ``REFERENCE_FLOPS``, ``REFERENCE_HOST_BANDWIDTH``,
``allocator_margin``; ``CUDA_CONTEXT_BYTES`` is measured on a GPU (the GPU suite's rows).
"""

import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mtune.models import build_model
from mtune.training.planning import cost, fit
from mtune.training.observe.peak_flops import cpu_model_name
from mtune.training.planning.memory_plan import CUDA_CONTEXT_BYTES

GIB = 1 << 30
STATED_LAUNCH_S = 15e-6  # MICRO_BATCH_OVERHEAD_S's stated per-kernel cost (launch plus small-kernel inefficiency)
EIGHT_B_BLOCKS = 32  # Llama 3.1 8B


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.views += any(r.alias_info is not None for r in func._schema.returns)  # no kernel: a view
        return func(*args, **(kwargs or {}))


def kernels_per_block() -> dict:
    """aten ops of forward+backward of the whole tiny model, less those of the same model with one block fewer."""
    counts = {}
    for n_layers in (2, 3):
        torch.manual_seed(0)
        model = build_model("llama3_1", "tiny", device="cpu", n_layers=n_layers)
        tokens = torch.randint(0, 512, (1, 16))
        with _CountOps() as seen:
            model(tokens).float().square().mean().backward()
        counts[n_layers] = (seen.ops, seen.views)
    return {"ops_2_blocks": counts[2][0], "ops_3_blocks": counts[3][0], "ops_per_block": counts[3][0] - counts[2][0],
            "views_per_block": counts[3][1] - counts[2][1],
            "kernels_per_block": (counts[3][0] - counts[3][1]) - (counts[2][0] - counts[2][1])}


def micro_batch_intercept(sizes=(8, 16, 32, 64, 128), calls: int = 8) -> dict:
    """Least-squares ``seconds = fixed + per_token * tokens`` over ``sizes`` (best of ``calls`` each)."""
    torch.manual_seed(0)
    model = build_model("llama3_1", "tiny", device="cpu")
    best = []
    for tokens in sizes:
        x = torch.randint(0, 512, (1, tokens))
        times = []
        for _ in range(calls + 1):
            start = time.perf_counter()
            model(x).float().square().mean().backward()
            times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
        best.append(min(times[1:]))  # the first call warms up
    n = len(sizes)
    mean_t, mean_s = sum(sizes) / n, sum(best) / n
    slope = sum((t - mean_t) * (s - mean_s) for t, s in zip(sizes, best)) / sum((t - mean_t) ** 2 for t in sizes)
    return {"tokens": list(sizes), "best_seconds": best, "fixed_seconds": mean_s - slope * mean_t,
            "seconds_per_token": slope}


def main(argv: list[str]) -> None:
    kernels = kernels_per_block()
    intercept = micro_batch_intercept()
    estimate = EIGHT_B_BLOCKS * kernels["kernels_per_block"] * STATED_LAUNCH_S
    constants = {
        "MICRO_BATCH_OVERHEAD_S": {
            "value": cost.MICRO_BATCH_OVERHEAD_S, "status": "stated; factor measured here",
            "derivation": f"{EIGHT_B_BLOCKS} blocks x {kernels['kernels_per_block']} non-view aten ops per block "
                          f"(measured) x {STATED_LAUNCH_S * 1e6:.0f} us (stated) = {estimate:.3f} s"},
        "REFERENCE_FLOPS": {"value": cost.REFERENCE_FLOPS, "status": "cited; waits for a lent GPU"},
        "REFERENCE_HOST_BANDWIDTH": {"value": cost.REFERENCE_HOST_BANDWIDTH, "status": "cited; waits for a lent GPU"},
        "CUDA_CONTEXT_BYTES": {"value": CUDA_CONTEXT_BYTES,
                               "status": "measured on one H100: benchmarks/results/derived_gpu_suite.json"},
        "allocator_margin": {"value": "max(1 GiB, 5%)", "at_24_gib": fit.allocator_margin(24 * GIB),
                             "status": "stated; measured on the GPU suite's rows and modelled (allocator_margin.py); "
                                       "runs held to it wait for a lent GPU (part 16)"},
        "HOST_ADAMW_SECONDS_PER_PARAM": {"value": cost.HOST_ADAMW_SECONDS_PER_PARAM,
                                         "status": "measured: benchmarks/results/host_adamw.json"},
    }
    print(f"aten ops per block, forward+backward: {kernels['ops_per_block']}, of which {kernels['views_per_block']} "
          f"views (no kernel): {kernels['kernels_per_block']} kernels (whole model: 2 blocks "
          f"{kernels['ops_2_blocks']}, 3 blocks {kernels['ops_3_blocks']} ops)")
    print(f"stated GPU overhead of an 8B micro-batch: {constants['MICRO_BATCH_OVERHEAD_S']['derivation']} "
          f"(constant {cost.MICRO_BATCH_OVERHEAD_S})")
    print(f"{'tokens':>7} {'best s':>9}")
    for tokens, seconds in zip(intercept["tokens"], intercept["best_seconds"]):
        print(f"{tokens:>7} {seconds:>9.4f}")
    print(f"this CPU: fixed {intercept['fixed_seconds'] * 1e3:.2f} ms per micro-batch, "
          f"{intercept['seconds_per_token'] * 1e6:.1f} us per token (tiny llama3_1, 2 blocks)")
    print(f"{'constant':>30} {'value':>14}  status")
    for name, row in constants.items():
        print(f"{name:>30} {str(row['value']):>14}  {row['status']}")
    out = Path(__file__).parent / "results" / "planner_constants.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}, {cpu_model_name()}",
        "date": time.strftime("%Y-%m-%d", time.gmtime()), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "load_average": os.getloadavg(),
        "kernels": kernels, "micro_batch_on_this_cpu": intercept, "constants": constants}, indent=1) + "\n")
    print(f"json: {out}")



if __name__ == "__main__":
    main(sys.argv[1:])

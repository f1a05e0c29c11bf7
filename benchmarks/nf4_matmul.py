"""The frozen NF4 matmul of QLoRA, one linear at a time: torchao's ``linear_nf4`` eager and compiled, mtune's eager
path (its dequantization one compiled kernel on CUDA, ``mtune/modules/nf4_dequantize.py``) and bitsandbytes'
``matmul_4bit`` (NF4, blocks of 64), with the bf16 matmul of the same dequantized weight as the baseline.

Each variant runs forward and the backward to its input (the weight is frozen, as under QLoRA) for Llama 3.1 8B's
block linears at 8,192 tokens (packed 4096 x 2, the GPU suite's QLoRA rows), timed with CUDA events after warm-up,
with the allocator's peak above the inputs and the largest difference from the baseline's output::

    python benchmarks/nf4_matmul.py                 # on a GPU: writes benchmarks/results/nf4_matmul.json
    python benchmarks/nf4_matmul.py --dry-run --out /tmp/nf4.json   # on a CPU: small shapes, the code path only

Which kernel QLoRA should use under compile is the GPU issue's question; this answers it per shape.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mtune.modules.nf4_linear import _nf4_api, dequantize, linear_maybe_nf4, quantize_nf4  # noqa: E402

SHAPES = {"q_proj/o_proj": (4096, 4096), "k_proj/v_proj": (1024, 4096), "gate_proj/up_proj": (14336, 4096),
          "down_proj": (4096, 14336)}
"""Llama 3.1 8B's block linears, ``(out_features, in_features)``."""
TOKENS = 8192


def variants() -> dict:
    """name -> (prepare(weight) -> state, run(x, state) -> y). Every run computes x @ W.T for the same NF4 weight."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf

    def torchao(w):
        return quantize_nf4(w)

    def torchao_linear(x, w):
        return _nf4_api().linear_nf4(input=x, weight=w)

    compiled = torch.compile(torchao_linear)

    def bnb_prepare(w):
        return bnbf.quantize_4bit(w, quant_type="nf4", blocksize=64)

    return {
        "bf16 (dequantized once)": (lambda w: dequantize(quantize_nf4(w)), lambda x, w: F.linear(x, w)),
        "torchao linear_nf4, eager": (torchao, torchao_linear),
        "torchao linear_nf4, compiled": (torchao, compiled),
        "mtune eager (dequantize compiled on CUDA)": (torchao, linear_maybe_nf4),
        "bitsandbytes matmul_4bit": (bnb_prepare, lambda x, s: bnb.matmul_4bit(x, s[0].t(), quant_state=s[1])),
    }


def timed(run, x, state, grad, *, warmup: int, reps: int, cuda: bool) -> tuple[list[float], int, torch.Tensor]:
    """Seconds of forward + backward to ``x`` per repetition, the allocator's peak above what was live before,
    and the output."""
    def once():
        x.grad = None
        y = run(x, state)
        y.backward(grad)
        return y

    for _ in range(warmup):
        once()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            y = once()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            y = once()
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() - before if cuda else 0
    return times, peak, y.detach()


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, small shapes: the code path only")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        raise SystemExit("no CUDA GPU here: run with --dry-run --out FILE on a CPU")
    if args.dry_run and args.out is None:
        raise SystemExit("--dry-run writes only where --out says (never into benchmarks/results)")
    device = "cuda" if cuda else "cpu"
    shapes = SHAPES if cuda else {"small": (256, 128)}
    tokens, warmup, reps = (TOKENS, 3, 10) if cuda else (64, 1, 2)
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for shape_name, (out_features, in_features) in shapes.items():
        weight = torch.randn(out_features, in_features, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
        x = torch.randn(tokens, in_features, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
        grad = torch.randn(tokens, out_features, device=device, dtype=torch.bfloat16, generator=gen)
        baseline = None
        for name, (prepare, run) in variants().items():
            state = prepare(weight)
            times, peak, y = timed(run, x, state, grad, warmup=warmup, reps=reps, cuda=cuda)
            baseline = y if baseline is None else baseline
            seconds = statistics.median(times)
            flops = 4 * tokens * out_features * in_features  # forward and the input's gradient, 2 flops a multiply-add
            rows.append({"shape": shape_name, "out_features": out_features, "in_features": in_features,
                         "tokens": tokens, "variant": name, "seconds": seconds, "times_s": times,
                         "tflops_per_s": flops / seconds / 1e12, "peak_above_inputs_bytes": peak,
                         "max_abs_difference": (y.float() - baseline.float()).abs().max().item()})
            print(f"{shape_name:<18} {name:<30} {seconds * 1e3:8.3f} ms  {flops / seconds / 1e12:7.1f} TFLOP/s  "
                  f"peak +{peak / 2**20:8.1f} MiB  max |diff| {rows[-1]['max_abs_difference']:.2e}", flush=True)
            del state
    import bitsandbytes
    import torchao

    out = args.out or REPO / "benchmarks" / "results" / "nf4_matmul.json"
    out.write_text(json.dumps({
        "machine": torch.cuda.get_device_name() if cuda else "cpu (dry run)",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "torchao": torchao.__version__, "bitsandbytes": bitsandbytes.__version__,
        "rows": rows}, indent=1) + "\n")
    print(f"json: {out}")
    return rows


if __name__ == "__main__":
    main()

"""Before/after timings of the step speedups, in one process, interleaved: each change is timed against the code it
replaced (kept here as ``*_before``), on the head-to-head fixture's shapes, so both sides see the same machine load.

    python benchmarks/step_speedups.py                       # batch 4 x 512, 8 layers, 5 rounds
    python benchmarks/step_speedups.py --batch 1 --layers 2  # quicker, on a busy machine

Changes timed (a training step = forward, chunked loss, backward, AdamW step, as ``mtune.training.loop.train_step``):
- ``lora_addmm``: LoRA's update added to the base output by one ``addmm`` (alpha = scaling) instead
  of ``lora_b(lora_a(x)) * scaling`` then ``base + lora``; LoRA step (q, v, o, gate, up, down; rank 8).
- ``loss_flat_chunks``: the chunked loss over contiguous chunks of the flattened tokens (one ``mm`` each) instead of
  slices of the sequence dimension (strided: a batched matmul each); LoRA and full fine-tuning steps.
- ``adamw_fused``: ``torch.optim.AdamW(fused=True)`` against ``foreach=True`` (mtune's CPU default before), on
  the full and the LoRA parameter sets; optimizer step alone.
- ``loss_grad_in_forward``: the chunked loss computing a plain head's gradients with its forward
  (``_ProjectedCrossEntropy``) instead of checkpointing each chunk and projecting it again in backward (the path
  LoRA-on-the-head still takes); full and LoRA steps.
- ``adamw_fused_step``: a whole full fine-tuning step with fused AdamW against foreach.
Prints a table and writes JSON (``--out``, default benchmarks/results/step_speedups.json) with the load average.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtune.models import build_model  # noqa: E402
from mtune.modules import loss as loss_module  # noqa: E402
from mtune.modules.lora import LoRALinear, apply_lora  # noqa: E402
from mtune.modules.nf4_linear import linear_maybe_nf4  # noqa: E402
from mtune.training.loop import train_step  # noqa: E402

LORA_MODULES = ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_forward_before(self, x):
    base = linear_maybe_nf4(x, self.weight)
    lora = self.lora_b(self.lora_a(self.dropout(x))) * self.scaling
    out = base + lora
    return out if self.bias is None else out + self.bias


def chunked_loss_strided(self, hidden, labels, lm_head):
    def chunk_loss(h, y):
        return loss_module._ce_sum(lm_head(h), y)

    total = hidden.new_zeros((), dtype=torch.float32)
    for h, y in zip(hidden.chunk(self.num_chunks, dim=1), labels.chunk(self.num_chunks, dim=1)):
        total = total + checkpoint(chunk_loss, h, y, use_reentrant=False)
    return total, (labels != loss_module.IGNORE_INDEX).sum()


def _model(args, lora: bool):
    torch.manual_seed(0)
    model = build_model("llama3_2", "tiny", device="cpu", dim=512, n_layers=args.layers, n_heads=8, n_kv_heads=2,
                        head_dim=64, intermediate_dim=1408, vocab_size=8192, tie_embeddings=False)
    if lora:
        apply_lora(model, LORA_MODULES, rank=8, alpha=16)
    return model.to(torch.bfloat16 if args.dtype == "bf16" else torch.float32)


def _batch(args):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 7936, (args.batch, args.seq), generator=g)
    idx = torch.arange(args.seq)
    return {"tokens": tokens, "labels": tokens.roll(-1, 1), "input_pos": (idx % 100).expand(args.batch, -1),
            "document_ids": (idx // 100).expand(args.batch, -1)}


def _step_timer(model, batch, optimizer_kwargs):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, **optimizer_kwargs)
    loss_fn = loss_module.ChunkedCrossEntropyLoss(8)

    def run():
        start = time.perf_counter()
        train_step(model, [batch], loss_fn, optimizer, device=torch.device("cpu"))
        return time.perf_counter() - start

    return run


def _optimizer_timer(model, kwargs):
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-4, **kwargs)

    def run():
        start = time.perf_counter()
        optimizer.step()
        return time.perf_counter() - start

    return run


@contextlib.contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def compare(name, before, after, rounds, warmup=1):
    """Median seconds of ``before()`` and ``after()`` (context-managed callables), alternating which goes first."""
    for fn in (before, after):
        for _ in range(warmup):
            fn()
    times = {"before": [], "after": []}
    for i in range(rounds):
        order = [("before", before), ("after", after)]
        for label, fn in order if i % 2 == 0 else order[::-1]:
            times[label].append(fn())
    b, a = statistics.median(times["before"]), statistics.median(times["after"])
    print(f"{name:28s} before {b * 1e3:9.1f} ms  after {a * 1e3:9.1f} ms  x{b / a:5.2f}  "
          f"(load {os.getloadavg()[0]:.1f})", flush=True)
    return {"name": name, "before_s": times["before"], "after_s": times["after"], "median_before_s": b,
            "median_after_s": a, "speedup": b / a, "loadavg": os.getloadavg()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="the model's weights and compute")
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "step_speedups.json")
    args = parser.parse_args()
    batch = _batch(args)
    results = []
    want = lambda n: args.only is None or n in args.only  # noqa: E731

    if want("lora_addmm"):
        model = _model(args, lora=True)
        step = _step_timer(model, batch, {"foreach": True})

        def before():
            with _patched(LoRALinear, "forward", lora_forward_before):
                return step()

        results.append(compare("lora_addmm (LoRA step)", before, step, args.rounds))
    if want("loss_flat_chunks"):
        for lora in (True, False):
            model = _model(args, lora=lora)
            step = _step_timer(model, batch, {"foreach": True})

            def before():
                with _patched(loss_module.ChunkedCrossEntropyLoss, "forward", chunked_loss_strided):
                    return step()

            results.append(compare(f"loss_flat_chunks ({'LoRA' if lora else 'full'} step)", before, step,
                                   args.rounds))
    if want("adamw_fused"):
        for lora in (False, True):
            model = _model(args, lora=lora)
            results.append(compare(f"adamw_fused ({'LoRA' if lora else 'full'} params)",
                                   _optimizer_timer(model, {"foreach": True}),
                                   _optimizer_timer(model, {"fused": True}), args.rounds * 2))
    if want("loss_grad_in_forward"):
        for lora in (False, True):
            model = _model(args, lora=lora)
            step = _step_timer(model, batch, {"foreach": True})

            def before():
                with _patched(loss_module, "_plain_projection_weight", lambda lm_head: None):
                    return step()

            results.append(compare(f"loss_grad_in_forward ({'LoRA' if lora else 'full'} step)", before, step,
                                   args.rounds))
    if want("adamw_fused_step"):
        model = _model(args, lora=False)
        results.append(compare("adamw_fused_step (full step)", _step_timer(model, batch, {"foreach": True}),
                               _step_timer(model, batch, {"fused": True}), args.rounds))
    meta = {"batch": args.batch, "seq": args.seq, "layers": args.layers, "rounds": args.rounds, "dtype": args.dtype,
            "threads": torch.get_num_threads(), "torch": torch.__version__}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()

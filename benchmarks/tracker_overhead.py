"""What ``plan_check``'s tensor tracker costs once its tracked steps are over (eager mode), on CPU.

A run tracks live tensor bytes over its first 3 steps (``plan_check``, on by default) and none after. This times the
steps after those against a run that never tracked (``plan_check=false``), the two alternating step by step in one
process on the same model, batch and optimizer (``setup_model``, ``build_optimizer``, ``train_step`` inside
``MemoryBreakdown.track_step`` as ``TrainingSession`` runs it), and counts the Python calls the tracker still gets
per step (its hooks on the trainable parameters). A third run keeps the hooks after the tracked steps, as the code
before 2026-11-24 did (``MemoryBreakdown`` now removes them with the last tracked step):

    python benchmarks/tracker_overhead.py                      # tiny LoRA, 16 layers (224 adapter tensors), 2 x 64
    python benchmarks/tracker_overhead.py --layers 4 --rounds 20 --seq 256
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from mtune.training.memory.registry import MemoryConfig  # noqa: E402
from mtune.models import model_args  # noqa: E402
from mtune.modules.loss import ChunkedCrossEntropyLoss  # noqa: E402
from mtune.training.loop import train_step  # noqa: E402
from mtune.training.planning.breakdown import MemoryBreakdown  # noqa: E402
from mtune.training.optimizers import build_optimizer, inner_optimizers  # noqa: E402
from mtune.training.planning.tracker import TensorTracker  # noqa: E402
from mtune.training.model_setup import ModelSource, setup_model  # noqa: E402

LORA = dict(modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], rank=8, alpha=16,
            dropout=0.0, use_dora=False, quantize_base=False)


def build(layers: int, tracked: bool, out: Path):
    torch.manual_seed(0)
    source = ModelSource("tiny", model_args("tiny", "tiny", n_layers=layers), None)
    model, _ = setup_model(source, device=torch.device("cpu"), dtype=torch.float32, lora=LORA, memory=MemoryConfig())
    optimizer = build_optimizer({"_component_": "torch.optim.AdamW", "lr": 1e-4}, model)
    breakdown = MemoryBreakdown(model, inner_optimizers(optimizer), out, enabled=tracked, write=False,
                                track_all_steps=False)
    return model, optimizer, breakdown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)  # per-step Python overhead is what is measured: keep the threads out of it
    calls = {"hook": 0}
    on_grad = TensorTracker._on_grad

    def counted(self, param):  # counts the tracker's gradient-hook calls without changing what they do
        calls["hook"] += 1
        on_grad(self, param)

    TensorTracker._on_grad = counted
    out = Path("/tmp/mtune_tracker_overhead")
    names = ("untracked", "plan_check", "plan_check, hooks kept")
    runs = {name: build(args.layers, name != "untracked", out) for name in names}
    g = torch.Generator().manual_seed(0)
    batch = {"tokens": torch.randint(0, 512, (args.batch, args.seq), generator=g),
             "labels": torch.randint(0, 512, (args.batch, args.seq), generator=g)}
    loss_fn = ChunkedCrossEntropyLoss(num_chunks=2)

    def step(name):
        model, optimizer, breakdown = runs[name]
        with breakdown.track_step():
            start = time.perf_counter()
            train_step(model, [batch], loss_fn, optimizer, device=torch.device("cpu"))
            return time.perf_counter() - start

    for _ in range(4):  # 3 tracked steps (plan_check's), then one more: the tracker is now off
        for name in names:
            step(name)
    kept = runs["plan_check, hooks kept"]
    kept[2].tracker.register_model(kept[0])  # the code before the fix: hooks stay on every trainable parameter
    times = {name: [] for name in names}
    hooks = dict.fromkeys(names, 0)
    for i in range(args.rounds):
        order = names[i % 3:] + names[:i % 3]
        for name in order:
            before = calls["hook"]
            times[name].append(step(name))
            hooks[name] += calls["hook"] - before
    median = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    trainable = sum(1 for p in runs["untracked"][0].parameters() if p.requires_grad)
    print(f"tiny LoRA, {args.layers} layers, {trainable} trainable tensors, batch {args.batch} x {args.seq}, 1 thread, "
          f"{args.rounds} rotating rounds after 4 steps (3 tracked); median step, tracker calls per step:")
    for name in names:
        print(f"  {name:<24} {median[name]:8.2f} ms  {median[name] / median['untracked']:.3f}x  "
              f"{hooks[name] / args.rounds:5.0f} gradient-hook calls")
    param = next(p for p in kept[0].parameters() if p.requires_grad)
    param.grad = torch.zeros_like(param)
    tracker, n = kept[2].tracker, 20000
    start = time.perf_counter()
    for _ in range(n):
        on_grad(tracker, param)
    print(f"one gradient-hook call (the tracker's Python, autograd's call excluded): "
          f"{(time.perf_counter() - start) / n * 1e6:.1f} us")


if __name__ == "__main__":
    main()

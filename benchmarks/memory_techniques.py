"""What each memory technique of mtune saves: live tensor bytes by category for one training step.

A Llama-architecture model (8 layers, dim 512, 8 heads / 4 KV heads, intermediate 1408, vocab 32000, tied
embeddings; ~40M parameters) is built with mtune's own `setup_model` / `build_optimizer` / `train_step`, as the
recipes do, on batch 2 x 512 tokens. Each row runs two optimizer steps: the first is measured, the second timed.

- parameters, optimizer state: each category's peak in `MemoryBreakdown.track_step()` around the measured step
  (live tensor bytes; NF4 weights and low-bit optimizer states by their inner tensors).
- gradients: the largest total of live `.grad` bytes seen in a post-accumulate-grad hook during backward (with
  optimizer_in_bwd this is one parameter's gradient at a time).
- activations: distinct storages saved for backward that stay on the compute device, parameters excluded, counted
  by a `saved_tensors_hooks` pack function placed where autograd calls it: outside checkpointed blocks (so a
  checkpointed block counts only the input it keeps) and inside the offloading hooks, which on a GPU would move
  the tensors counted under `offloadable` to host memory. Without CUDA nothing moves.
- logits peak (plain vs chunked loss rows): the most bytes of fp32 [.., vocab] tensors alive at once during
  forward and backward, tracked by a dispatch mode.
- offloading rows (optimizer_offload, weight_offloading) run with a distinct placement (`Placement("cpu",
  distinct=True)`: every move a real copy, host storages told apart), so the columns count what stays on the compute
  device and a note gives what waits in host memory.

    python benchmarks/memory_techniques.py [--rows NAME ...] [--out benchmarks/results/memory_techniques.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import sys
import tempfile
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# torchao's low-bit optimizers compile one kernel per parameter shape on first use; keep the cache out of ~.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / "mtune_bench_inductor"))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402
from torch.utils.checkpoint import CheckpointPolicy  # noqa: E402

import mtune.training.memory.techniques.activation_checkpointing.checkpoint as checkpointing  # noqa: E402
import mtune.training.memory.techniques.activation_offloading.offload as offloading  # noqa: E402
from mtune.training.memory.registry import MemoryConfig  # noqa: E402
from mtune.training.memory.techniques.weight_offloading import WeightOffloading  # noqa: E402
from mtune.models import model_args  # noqa: E402
from mtune.modules.loss import ChunkedCrossEntropyLoss, CrossEntropyLoss  # noqa: E402
from mtune.training.loop import train_step  # noqa: E402
from mtune.training.memory.tensor_bytes import tensor_storage_bytes
from mtune.training.planning.breakdown import MemoryBreakdown  # noqa: E402
from mtune.training.optimizers import build_optimizer, inner_optimizers  # noqa: E402
from mtune.training.memory.techniques.optimizer_offload.cpu_optimizer import CPUOffloadOptimizer  # noqa: E402
from mtune.training.placement import Placement, storage_key  # noqa: E402
from mtune.training.precision import DTYPES  # noqa: E402
from mtune.training.memory.techniques.weight_offloading.offloader import weight_offloader  # noqa: E402
from mtune.training.model_setup import ModelSource, setup_model  # noqa: E402

MODEL = dict(vocab_size=32000, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, head_dim=64, intermediate_dim=1408,
             max_seq_len=512)  # every linear's numel is a multiple of 16384, as NF4 needs
BATCH, SEQ = 2, 512
MiB = 2**20
LORA = dict(modules=["q_proj", "k_proj", "v_proj", "o_proj"], rank=8, alpha=16, dropout=0.0, use_dora=False,
            quantize_base=False)


@dataclass(frozen=True)
class Row:
    name: str
    dtype: str = "fp32"
    optimizer: str = "torch.optim.AdamW"
    lora: dict | None = None
    checkpointing: bool = False
    every_n_layers: int = 1
    offloading: bool = False
    optimizer_in_bwd: bool = False
    chunked_loss: bool = False
    checkpointing_policy: str = "block"
    weight_storage: str | None = None
    optimizer_offload: str | None = None
    weight_offloading: WeightOffloading | None = None


ROWS = [
    Row("full fp32, AdamW (baseline)"),
    Row("bf16", "bf16"),
    Row("bf16 + activation checkpointing", "bf16", checkpointing=True),
    Row("bf16 + AC every 2 layers", "bf16", checkpointing=True, every_n_layers=2),
    Row("bf16 + AC + offloading", "bf16", checkpointing=True, offloading=True),
    Row("optimizer_in_bwd", optimizer_in_bwd=True),
    Row("bitsandbytes AdamW8bit", optimizer="bitsandbytes.optim.AdamW8bit"),
    Row("torchao AdamW8bit", optimizer="torchao.optim.AdamW8bit"),
    Row("torchao AdamW4bit", optimizer="torchao.optim.AdamW4bit"),
    Row("torchao AdamWFp8", optimizer="torchao.optim.AdamWFp8"),
    Row("LoRA r8 (q,k,v,o)", lora=LORA),
    Row("LoRA r8, bf16", "bf16", lora=LORA),
    Row("QLoRA r8 (NF4 base, bf16)", "bf16", lora={**LORA, "quantize_base": True}),
    Row("chunked cross-entropy (8 chunks)", chunked_loss=True),
    # fp32 (bf16 matmuls on a shared 2-core CPU took 350 s a step): compare with the baseline and LoRA r8 (q,k,v,o)
    Row("activation checkpointing (fp32)", checkpointing=True),
    Row("selective_op checkpointing (fp32)", checkpointing=True, checkpointing_policy="selective_op"),
    Row("LoRA r8, fp8 base (e4m3)", lora=LORA, weight_storage="float8_e4m3fn"),
    # optimizer_offload / weight_offloading: device bytes in the columns, host bytes in notes
    Row("optimizer_offload=cpu", optimizer_offload="cpu"),
    Row("LoRA r8 + weight_offloading block_level", lora=LORA, weight_offloading=WeightOffloading("block_level", 1, False)),
    Row("LoRA r8 + weight_offloading leaf_level", lora=LORA, weight_offloading=WeightOffloading("leaf_level", 1, False)),
]


class SavedBytes:
    """A pack function for `saved_tensors_hooks` that counts the distinct storages saved for backward
    (parameters excluded) and hands every tensor back unchanged."""

    def __init__(self):
        self.seen: set = set()
        self.bytes = 0
        self.active = True  # off after the measured step
        self.parameter_storages: set = set()

    def exclude_parameters(self, model: torch.nn.Module) -> None:
        self.seen |= tensor_storage_bytes(model.parameters())[1]
        # By identity too: a weight that weight_offloading has sent away has an empty storage now and a new address
        # when it comes back, but it is still the parameter's storage.
        self.parameter_storages = {storage_key(p) for p in model.parameters() if type(p.data) is torch.Tensor}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self.active or (type(tensor) is torch.Tensor and storage_key(tensor) in self.parameter_storages):
            return tensor
        nbytes, keys = tensor_storage_bytes([tensor], exclude=self.seen)
        self.seen |= keys
        self.bytes += nbytes
        return tensor

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)


@contextlib.contextmanager
def counted_no_offload(counter: SavedBytes):
    # Offloading keeps model.norm / model.lm_head tensors in place under its own NoOffload hooks, which would hide
    # them from the counter: build those hooks with the counter's pack function instead (still identity).
    original = offloading.NoOffload
    offloading.NoOffload = counter.hooks
    try:
        yield
    finally:
        offloading.NoOffload = original


@contextlib.contextmanager
def counted_selective_saves(counter: SavedBytes):
    # selective_op keeps the outputs of the ops its policy saves in checkpoint's own cache, not through
    # saved_tensors_hooks: count them where the policy decides (first forward only, not the recompute).
    policy = checkpointing.selective_op_policy

    def counting_policy(ctx, func, *args, **kwargs):
        decision = policy(ctx, func, *args, **kwargs)
        if decision == CheckpointPolicy.MUST_SAVE and not ctx.is_recompute:
            for t in tree_leaves(ctx.op_output):
                if isinstance(t, torch.Tensor):
                    counter.pack(t)
        return decision

    checkpointing.selective_op_policy = counting_policy
    try:
        yield
    finally:
        checkpointing.selective_op_policy = policy


def count_offloadable(ctx: offloading.OffloadActivations, counter: SavedBytes) -> dict:
    """Wrap the offloading pack hook: count every tensor it receives, and the bytes it would move to host on a GPU
    (its own test minus the device check: plain tensors of at least min_offload_bytes not sharing a parameter's
    storage; see `OffloadActivations._should_offload`)."""
    moved = {"bytes": 0, "tensors": 0, "distinct_bytes": 0}
    seen: set = set()
    pack = ctx.pack_hook

    def counting_pack(tensor):
        counter.pack(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        if (counter.active and type(tensor) is torch.Tensor and nbytes >= ctx.min_offload_bytes
                and storage_key(tensor) not in ctx._param_storages):
            moved["bytes"] += nbytes  # copies: a storage saved twice (log_softmax's output) is copied twice
            moved["tensors"] += 1
            distinct, keys = tensor_storage_bytes([tensor], exclude=seen)
            seen.update(keys)
            moved["distinct_bytes"] += distinct
        return pack(tensor)

    ctx.pack_hook = counting_pack  # read by __enter__, which the model's forward pre-hook calls
    return moved


class GradientPeak:
    """The most gradient bytes alive at once during backward, seen from post-accumulate-grad hooks. Register before
    `build_optimizer`, so with optimizer_in_bwd these hooks run before the one that steps and frees the gradient."""

    def __init__(self, model: torch.nn.Module):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.peak = 0
        self.active = True
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, _param) -> None:
        if self.active:
            live = tensor_storage_bytes(p.grad for p in self.params if p.grad is not None)[0]
            self.peak = max(self.peak, live)


class LogitsPeak(TorchDispatchMode):
    """Peak bytes of live fp32 tensors whose last dimension is the vocabulary (logits, their log-softmax and
    gradients); a storage counts from the first op that returns it until no tensor using it is alive."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.live: dict[int, list] = {}  # storage data_ptr -> [nbytes, set of tensor weakref ids]
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and type(t) is torch.Tensor:
                self._track(t, inputs)
        return out

    def _track(self, t: torch.Tensor, inputs: set) -> None:
        key = t.untyped_storage().data_ptr()
        if key not in self.live:
            # A storage counts only when an op allocates it, not when one returns a view of its input: this skips
            # the transposed lm_head weight and its gradient, which also end in a vocab-sized dimension.
            if key in inputs or t.dtype != torch.float32 or t.dim() < 2 or t.shape[-1] != self.vocab_size:
                return
            nbytes = t.untyped_storage().nbytes()
            self.live[key] = [nbytes, set()]
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        refs = self.live[key][1]
        ref = weakref.ref(t, lambda r, key=key: self._release(key, r))
        refs.add(ref)

    def _release(self, key: int, ref) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1].discard(ref)
        if not entry[1]:
            self.current -= entry[0]
            del self.live[key]


def measure(row: Row) -> dict:
    torch.manual_seed(0)
    device = torch.device("cpu")
    dtype = DTYPES[row.dtype]
    source = ModelSource("llama3_2", model_args("llama3_2", "tiny", **MODEL), None)
    saved = SavedBytes()
    placement = Placement(device, distinct=bool(row.optimizer_offload or row.weight_offloading))
    with counted_no_offload(saved):
        memory = MemoryConfig(enable_activation_checkpointing=row.checkpointing,
                              activation_checkpointing_every_n_layers=row.every_n_layers,
                              enable_activation_offloading=row.offloading, optimizer_in_bwd=row.optimizer_in_bwd,
                              activation_checkpointing_policy=row.checkpointing_policy,
                              weight_storage_dtype=row.weight_storage,
                              optimizer_offload=row.optimizer_offload, weight_offloading=row.weight_offloading)
        model, offload_ctx = setup_model(source, device=device, dtype=dtype, lora=row.lora, memory=memory,
                                         placement=placement)
    saved.exclude_parameters(model)
    offloadable = count_offloadable(offload_ctx, saved) if offload_ctx is not None else None
    grads = GradientPeak(model)
    optimizer = build_optimizer({"_component_": row.optimizer, "lr": 1e-4}, model, memory, placement=placement)
    breakdown = MemoryBreakdown(model, inner_optimizers(optimizer), tempfile.gettempdir(), num_steps=1, write=False,
                                placement=placement)
    loss_fn = ChunkedCrossEntropyLoss(num_chunks=8) if row.chunked_loss else CrossEntropyLoss()
    logits = LogitsPeak(MODEL["vocab_size"]) if row.dtype == "fp32" and row.lora is None and row.optimizer == \
        "torch.optim.AdamW" and not row.optimizer_in_bwd else None

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ + 1), generator=generator)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:].clone()}

    def step(measure: bool):
        contexts = contextlib.ExitStack()
        with contexts:
            if measure:
                contexts.enter_context(saved.hooks())
                contexts.enter_context(counted_selective_saves(saved))
                if logits is not None:
                    contexts.enter_context(logits)
            if offload_ctx is not None:  # innermost, as the recipe's session enters it: the loss is offloaded too
                contexts.enter_context(offload_ctx)
            if measure:
                contexts.enter_context(breakdown.track_step())
            return train_step(model, [batch], loss_fn, optimizer, device=device)

    start = time.perf_counter()
    first = step(measure=True)
    first_seconds = time.perf_counter() - start
    grads.active = saved.active = False
    start = time.perf_counter()
    second = step(measure=False)
    seconds = time.perf_counter() - start

    record = breakdown.records[0]["category_peak"]["device"]  # the compute device's bytes (distinct placement)
    host = host_bytes(model, optimizer, placement)
    result = {
        "name": row.name,
        "config": asdict(row),
        "parameters": record["parameters"],
        "buffers": record["buffers"],
        "gradients": grads.peak,
        "gradients_after_step": record["gradients"],
        # A CPUOffloadOptimizer's states are host memory (on a GPU machine, the cpu device); on the distinct CPU
        # placement the tracker sees them allocated by the first step before the optimizer marks them as host.
        "optimizer_state": max(0, record["optimizer_state"] - host["optimizer_state"]),
        "host": host if placement.distinct else None,
        "activations": saved.bytes,
        "offloaded_copy_bytes": offloadable["bytes"] if offloadable else None,
        "offloaded_copies": offloadable["tensors"] if offloadable else None,
        "offloadable_activations": offloadable["distinct_bytes"] if offloadable else None,
        "fp32_logits_peak": logits.peak if logits is not None else None,
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "losses": [first.loss, second.loss],
        "first_step_seconds": first_seconds,
        "step_seconds": seconds,
    }
    result["total"] = sum(result[k] for k in ("parameters", "gradients", "optimizer_state", "activations"))
    return result


def host_bytes(model, optimizer, placement: Placement) -> dict:
    """What offloading keeps in host memory: optimizer states, the optimizer's parameter copies and gradient
    buffers (optimizer_offload), frozen weights (weight_offloading)."""
    states = [t for opt in inner_optimizers(optimizer) for s in opt.state.values() for t in s.values()
              if isinstance(t, torch.Tensor) and placement.distinct and placement.on_host(t)]
    result = {"optimizer_state": tensor_storage_bytes(states)[0], "parameter_copies": 0, "gradients": 0,
              "frozen_weights": 0}
    if isinstance(optimizer, CPUOffloadOptimizer):
        result["parameter_copies"] = tensor_storage_bytes(optimizer.host_params)[0]
        result["gradients"] = tensor_storage_bytes(g for g in optimizer._grads if g is not None)[0]
    offloader = weight_offloader(model)
    if offloader is not None:
        result["frozen_weights"] = sum(slot.nbytes for slots in offloader._slots for slot in slots)
    return result


def markdown_table(results: list[dict]) -> str:
    base = results[0]["total"]
    lines = ["| technique | parameters | gradients | optimizer state | activations | total (MiB) | × baseline "
             "| CPU step (s) | notes |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        notes = []
        if r["offloadable_activations"] is not None:
            notes.append(f"on a GPU {r['offloadable_activations'] / MiB:.1f} MiB of these would leave the device "
                         f"({r['offloaded_copies']} copies, {r['offloaded_copy_bytes'] / MiB:.1f} MiB to host); "
                         "on CPU nothing moves")
        if r["fp32_logits_peak"] is not None:
            notes.append(f"fp32 logits peak {r['fp32_logits_peak'] / MiB:.1f} MiB")
        if r["config"]["weight_storage"]:
            notes.append(f"plus {r['buffers'] / MiB:.2f} MiB of fp32 row scales (buffers), also counted as saved "
                         "activations (backward keeps them beside the fp8 codes)")
        if r["config"]["optimizer_in_bwd"]:
            notes.append("gradients: most alive at once in backward")
        if r["host"] is not None:
            h = r["host"]
            parts = [f"{label} {h[key] / MiB:.1f}" for key, label in (
                ("optimizer_state", "optimizer state"), ("parameter_copies", "parameter copies"),
                ("gradients", "gradients"), ("frozen_weights", "frozen weights")) if h[key]]
            notes.append(f"device bytes; host: {', '.join(parts)} MiB")
            if r["config"]["optimizer_offload"]:
                notes.append("gradients: the most on the device at once (each leaves when complete)")
        cells = [r[k] / MiB for k in ("parameters", "gradients", "optimizer_state", "activations", "total")]
        lines.append(f"| {r['name']} | " + " | ".join(f"{c:.1f}" for c in cells)
                     + f" | {r['total'] / base:.2f} | {r['step_seconds']:.1f} | {'; '.join(notes)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", help="row names to run (default: all; the first is the baseline)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "memory_techniques.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(os.cpu_count() or 1)
    rows = [r for r in ROWS if not args.rows or r.name in args.rows]
    results = []
    start = time.perf_counter()
    for row in rows:
        results.append(measure(row))
        r = results[-1]
        print(f"{row.name}: total {r['total'] / MiB:.1f} MiB, loss {r['losses'][0]:.4f}, "
              f"step {r['step_seconds']:.1f} s (first {r['first_step_seconds']:.1f} s)", file=sys.stderr, flush=True)
    table = markdown_table(results)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "unit": "bytes",
        "model": MODEL | {"family": "llama3_2", "tie_embeddings": True},
        "batch": [BATCH, SEQ],
        "machine": {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
                    "torch": torch.__version__, "cuda": torch.cuda.is_available()},
        "wall_seconds": time.perf_counter() - start,
        "rows": results,
        "table": table,
    }, indent=2))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()

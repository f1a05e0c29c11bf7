"""``mtune plan``: the peak memory of a training config, predicted before any GPU is touched.

:func:`plan_memory` builds the model, adapters, NF4 weights, optimizer and every memory technique with the
recipe's own setup code (:func:`~mtune.training.model_setup.setup_model` on the meta device, then
:func:`~mtune.training.model_setup.materialize_model` and :func:`~mtune.training.memory.optimizers.build_optimizer`
under ``FakeTensorMode``), then runs two optimizer steps of the training loop's own tensor work
(:func:`~mtune.training.loop.step_on_tensors`) on fake tensors while the run's byte tracker
(:class:`~mtune.training.memory.tracker.TensorTracker`) counts live bytes by category on the device and on the
host. No weight file is read (only the checkpoint's ``config.json``) and no tensor memory is allocated, so an 8B
config plans on a laptop.

- The batch is ``batch_size`` rows of ``tokenizer.max_seq_len`` tokens (packed rows with their document ids when
  ``dataset.packed``), every token trained: the largest batch the config can produce.
- Step 1 runs one small micro-batch (1 x 16 tokens): its optimizer step creates the optimizer state, which may
  peak higher than any later step (lazy state creation; FSDP2's first step), and does not depend on the batch;
  its forward and backward peak below step 2's, which has the same tensors and the optimizer state too. Step 2
  runs ``min(gradient_accumulation_steps, 2)`` full micro-batches: the second has the first's gradients alive, as
  every later one does, so the peak of any number of micro-batches is seen. The plan is the larger of the two.
- The compute device is modelled by fake CPU tensors; for a CUDA target the host is a distinct
  :class:`~mtune.training.memory.placement.Placement` host, so offloaded tensors count there, and every device
  storage is rounded up to the caching allocator's 512-byte blocks: the device peak predicts
  ``torch.cuda.max_memory_allocated()``. :data:`CUDA_CONTEXT_BYTES` is added for the whole-GPU figure
  (``nvidia-smi``).
- A distributed recipe's config is planned for rank 0 of ``world_size`` ranks (``--nproc_per_node``): a fake
  process group of that size (no communication), the recipe's own FSDP2 sharding
  (:func:`~mtune.training.distributed.shard_model`) and sharded initialisation, then the same two steps: the
  per-rank shards, FSDP2's all-gather and reduce-scatter buffers and resharding after forward are all live tensors
  the tracker sees.
- Optimizers that cannot step on fake tensors (bitsandbytes) are replaced by stand-ins that create the documented
  state layout (:mod:`mtune.training.memory.optimizer_layouts`).
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from mtune.config import instantiate
from mtune.config.errors import ConfigError
from mtune.config.keys import MemoryConfig
from mtune.errors import MtuneError
from mtune.modules.loss import CrossEntropyLoss
from mtune.training.loop import step_on_tensors
from mtune.training.memory.optimizer_layouts import LAYOUT_STANDINS
from mtune.training.memory.optimizers import build_optimizer, inner_optimizers
from mtune.training.memory.placement import Placement
from mtune.training.memory.precision import autocast, storage_dtype
from mtune.training.memory.tracker import CATEGORIES, TensorTracker
from mtune.training.distributed import shard_model
from mtune.training.model_setup import (
    ModelSource,
    init_weights_sharded,
    materialize_model,
    reset_adapters_sharded,
    resolve_model_source,
    setup_model,
)
from mtune.training.observe.plots import plot_memory_plan

__all__ = ["MemoryPlan", "PlanError", "plan_memory", "plan_summary_line", "parse_bytes", "format_bytes",
           "CUDA_CONTEXT_BYTES", "CUDA_BLOCK_BYTES"]

log = logging.getLogger(__name__)

GIB = 1024**3
CUDA_BLOCK_BYTES = 512
"""The caching allocator rounds every request up to a multiple of 512 bytes; ``max_memory_allocated`` counts that."""
CUDA_CONTEXT_BYTES = 512 * 1024**2
"""What a CUDA process takes on the GPU outside the caching allocator (the context, cuBLAS/cuDNN handles and their
kernels): about 0.5 GiB with CUDA 12 on an H100/A100 (it varies a little with the driver and the libraries
loaded). Added to the whole-GPU figure only; ``max_memory_allocated`` does not see it."""

UNSUPPORTED_BY_PLANNER = ("torchao.optim.",)


class PlanError(MtuneError, RuntimeError):
    """The planner cannot plan this config (it names the key and what to do)."""


@dataclass
class MemoryPlan:
    """A plan: the predicted peaks (bytes) and what makes them up. ``device`` / ``host``: each category's own peak;
    ``at_peak``: what is live at the instant of each location's peak."""

    target: str
    world_size: int
    device_peak_bytes: int
    host_peak_bytes: int
    device: dict[str, int]
    host: dict[str, int]
    at_peak: dict[str, dict[str, int]]
    batch: dict[str, int]
    parameters: dict[str, int]
    predicts: str
    cuda_context_bytes: int = 0
    device_memory: int | None = None
    host_memory: int | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def device_total_bytes(self) -> int:
        """The device peak plus the CUDA context: what the GPU must hold."""
        return self.device_peak_bytes + self.cuda_context_bytes

    def fits(self) -> dict[str, int | None]:
        """Spare bytes per location (negative: short by that much); None where no budget was given."""
        return {
            "device": None if self.device_memory is None else self.device_memory - self.device_total_bytes,
            "host": None if self.host_memory is None else self.host_memory - self.host_peak_bytes,
        }

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["device_total_bytes"] = self.device_total_bytes
        out["spare_bytes"] = self.fits()
        out["unit"] = "bytes"
        return out

    def plot(self, out_png) -> Any:
        """The stacked bar chart (PNG) of what is live at each location's peak; None without matplotlib."""
        return plot_memory_plan(self.at_peak, out_png, CATEGORIES, title=f"mtune plan: {self.target}",
                                context_bytes=self.cuda_context_bytes, budget_bytes=self.device_memory)

    def table(self) -> str:
        """The plan as text: the peaks, each category's peak and what is live at the peak, and whether it fits."""
        lines = [f"target: {self.target}" + (f" x {self.world_size} ranks (per rank)" if self.world_size > 1 else "")
                 + f"; batch {self.batch['batch_size']} x {self.batch['seq_len']} tokens"
                 + (f", {self.batch['accumulation']} micro-batches per step" if self.batch["accumulation"] > 1 else ""),
                 f"parameters: {self.parameters['total']:,} ({self.parameters['trainable']:,} trainable)",
                 "",
                 f"{'category':<18}{'device peak':>14}{'at device peak':>16}{'host peak':>14}"]
        for category in CATEGORIES:
            lines.append(f"{category:<18}{format_bytes(self.device[category]):>14}"
                         f"{format_bytes(self.at_peak['device'][category]):>16}{format_bytes(self.host[category]):>14}")
        lines.append(f"{'peak':<18}{format_bytes(self.device_peak_bytes):>14}{'':>16}"
                     f"{format_bytes(self.host_peak_bytes):>14}")
        lines.append("")
        if self.cuda_context_bytes:
            lines.append(f"predicted torch.cuda.max_memory_allocated(): {format_bytes(self.device_peak_bytes)}; "
                         f"with the CUDA context (~{format_bytes(self.cuda_context_bytes)}): "
                         f"{format_bytes(self.device_total_bytes)} on the GPU")
        else:
            lines.append(f"predicted peak of live tensors on {self.target}: {format_bytes(self.device_peak_bytes)} "
                         f"(peak_tensor_gib in metrics.jsonl)")
        lines.append(f"host (offloaded tensors): {format_bytes(self.host_peak_bytes)}")
        for where, spare in self.fits().items():
            if spare is None:
                continue
            budget = self.device_memory if where == "device" else self.host_memory
            verdict = (f"fits in {format_bytes(budget)} with {format_bytes(spare)} to spare" if spare >= 0
                       else f"does NOT fit in {format_bytes(budget)}: {format_bytes(-spare)} short")
            lines.append(f"{where}: {verdict}")
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(text: str, what: str = "memory") -> int:
    """``24GiB``, ``80GB``, ``512MiB``, ``1.5TB``, or a number of bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(f"{what}={text!r}: write a size such as 24GiB, 80GB or 512MiB")
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: int | float) -> str:
    if abs(n) >= GIB:
        return f"{n / GIB:.2f} GiB"
    return f"{n / 1024**2:.1f} MiB"


def _target(device: str) -> torch.device:
    """The device a run of this config would compute on: ``auto`` is CUDA when this machine has it, else the CPU;
    ``cuda`` is accepted without a GPU (nothing runs on it)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(torch.device(device).type)


def _model_source(cfg):
    source = resolve_model_source(cfg.model)  # reads config.json only
    return ModelSource(source.family, source.args, None)  # random init under fake tensors: no weight file is read


def _optimizer_node(cfg) -> dict:
    node = dict(cfg.optimizer)
    component = node.get("_component_", "")
    if component.startswith(UNSUPPORTED_BY_PLANNER):
        raise PlanError(f"optimizer._component_={component}: the planner cannot run torchao's low-bit optimizers on "
                        "fake tensors yet; plan with bitsandbytes.optim.AdamW8bit (the same state bytes) instead")
    if component in LAYOUT_STANDINS:
        node["_component_"] = LAYOUT_STANDINS[component]
    return node


def _batch(cfg, vocab_size: int, micro_batches: int, small: bool = False) -> list[dict]:
    seq_len = cfg.tokenizer.get("max_seq_len")
    if not seq_len:
        raise ConfigError("tokenizer.max_seq_len is null: the planner needs the longest sample length; set "
                          "tokenizer.max_seq_len=N")
    batch_size = int(cfg.batch_size)
    if small:  # step 1 only creates the optimizer state, whose size does not depend on the batch
        batch_size, seq_len = 1, min(seq_len, 16)
    packed = bool((cfg.get("dataset") or {}).get("packed"))
    batches = []
    for _ in range(micro_batches):
        batch = {"tokens": torch.randint(0, vocab_size, (batch_size, seq_len)),
                 "labels": torch.randint(0, vocab_size, (batch_size, seq_len))}
        if packed:  # two documents per row: the block-causal mask path of a packed run
            half = seq_len // 2
            batch["input_pos"] = torch.cat([torch.arange(half), torch.arange(seq_len - half)]).expand(batch_size, -1)
            batch["document_ids"] = torch.cat([torch.zeros(half, dtype=torch.long),
                                               torch.ones(seq_len - half, dtype=torch.long)]).expand(batch_size, -1)
        batches.append(batch)
    return batches


def plan_memory(cfg, *, device_memory: int | None = None, host_memory: int | None = None,
                fake: bool = True, world_size: int = 1) -> MemoryPlan:
    """Plan ``cfg`` (a training config with its recipe's defaults filled in). With ``fake=False`` the same
    steps run on real tensors (tests compare the two)."""
    sharded = "fsdp_reshard_after_forward" in cfg  # a distributed recipe's config
    if world_size != 1 and not sharded:
        raise PlanError(f"--nproc_per_node {world_size}: recipe {cfg.get('recipe')} runs on one device; plan a "
                        "*_distributed recipe's config for several ranks")
    if fake and sharded and dist.is_initialized():
        raise PlanError("plan a distributed config from a process without a process group (the planner makes a "
                        "fake one of the given world size)")
    start = time.perf_counter()
    target = _target(str(cfg.device))
    cuda = target.type == "cuda"
    placement = Placement("cpu", "cpu", distinct=target.type != "cpu")
    memory = MemoryConfig.from_config(cfg)
    notes = []
    if memory.compile:
        memory = MemoryConfig(**{**asdict(memory), "compile": False})
        notes.append("compile=true is planned eagerly: compiled blocks may hold fewer intermediates")
    if str(cfg.optimizer.get("_component_", "")).startswith("bitsandbytes.optim.Paged") and cuda:
        notes.append("paged optimizer states are counted on the GPU; under memory pressure the driver pages them "
                     "to the host")
    dtype_name = str(cfg.dtype)
    dtype = storage_dtype(dtype_name)
    source = _model_source(cfg)
    lora = cfg.get("lora")
    model, activation_context = setup_model(source, device=torch.device("cpu"), dtype=dtype, lora=lora,
                                            memory=memory, materialize=False, placement=placement)
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None  # meta tensors go in
    accumulation = int(cfg.get("gradient_accumulation_steps") or 1)
    logging.getLogger("mtune").disabled = True  # setup's own log lines are about a run, not a plan
    fake_group = False
    try:
        if sharded:
            if cfg.get("fsdp_cpu_offload"):
                notes.append("fsdp_cpu_offload: the shards, gradients and optimizer state FSDP2 keeps on the CPU "
                             "are counted on the device (not modelled yet)")
            if not dist.is_initialized():  # rank 0 of a fake process group of world_size ranks: no communication
                from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

                dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
                fake_group = True
            shard_model(model, reshard_after_forward=cfg.fsdp_reshard_after_forward, cpu_offload=False)
        with mode if mode is not None else contextlib.nullcontext(), warnings.catch_warnings():
            # torchao's NF4 all-gather compares storage pointers, which fake tensors lack: harmless here
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            if sharded:  # setup_sharded_model's own steps after sharding: each rank's rows, then the adapters
                torch.manual_seed(int(cfg.get("seed") or 0))
                init_weights_sharded(model, "cpu")
                if lora is not None:
                    reset_adapters_sharded(model)
            else:
                materialize_model(model, source, device=torch.device("cpu"), dtype=dtype, lora=lora)
            optimizer = build_optimizer(_optimizer_node(cfg), model, optimizer_in_bwd=memory.optimizer_in_bwd,
                                        optimizer_offload=memory.optimizer_offload, placement=placement,
                                        target_device=target)
            loss_fn = instantiate(cfg.get("loss")) or CrossEntropyLoss()
            tracker = TensorTracker(placement, model=model, optimizers=inner_optimizers(optimizer),
                                    device_alignment=CUDA_BLOCK_BYTES if cuda else 1, fake_mode=mode)
            for step, micro_batches in enumerate((1, min(accumulation, 2))):
                with tracker:
                    batches = _batch(cfg, source.args.vocab_size, micro_batches, small=step == 0)
                    with activation_context if activation_context is not None else contextlib.nullcontext():
                        step_on_tensors(model, batches, loss_fn, optimizer,
                                        denominator=torch.tensor(float(micro_batches * batches[0]["tokens"].numel()))
                                        / world_size,
                                        device=torch.device("cpu"),
                                        autocast=lambda: autocast(dtype_name, target),
                                        clip_grad_norm=cfg.get("clip_grad_norm"))
                    del batches
                interval = tracker.take_interval()
                peaks = interval if step == 0 else peaks.merge(interval)
    finally:
        logging.getLogger("mtune").disabled = False
        if fake_group:
            dist.destroy_process_group()
    params = list(model.parameters())
    return MemoryPlan(
        target=str(target), world_size=world_size,
        device_peak_bytes=peaks.peak["device"], host_peak_bytes=peaks.peak["host"],
        device=peaks.category_peak["device"], host=peaks.category_peak["host"], at_peak=peaks.at_peak,
        batch={"batch_size": int(cfg.batch_size), "seq_len": int(cfg.tokenizer.max_seq_len),
               "accumulation": accumulation},
        parameters={"total": sum(p.numel() for p in params),
                    "trainable": sum(p.numel() for p in params if p.requires_grad)},
        predicts="torch.cuda.max_memory_allocated()" if cuda else "peak_tensor_gib (live tensor bytes)",
        cuda_context_bytes=CUDA_CONTEXT_BYTES if cuda else 0,
        device_memory=device_memory, host_memory=host_memory,
        seconds=time.perf_counter() - start, notes=notes,
    )


def plan_summary_line(plan: MemoryPlan) -> str:
    return (f"planned peak {format_bytes(plan.device_peak_bytes)} on {plan.target}, "
            f"{format_bytes(plan.host_peak_bytes)} on the host")

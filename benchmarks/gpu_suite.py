"""mtune on one lent GPU, measured against its own plan and against torchtune 0.6.1, in parts of at most 8 minutes.

    python benchmarks/gpu_suite.py --list                                 # the cases, by part, with their state
    python benchmarks/gpu_suite.py --part 1                               # on the GPU: appends to results/gpu_suite.json
    python benchmarks/gpu_suite.py --part 1 --cases llama3_2_1B_lora_compiled
    python benchmarks/gpu_suite.py --dry-run --out /tmp/gpu_suite.json    # on a CPU: every part, tiny shapes

Every case is a row of :data:`CASES` (data, not code): a shipped config, the overrides that make it the case (random
weights by ``model.family`` / ``model.size``, bf16, the batch and sequence length), and how it is measured:

- ``run``: the recipes' own setup (``setup_run``, ``setup_model``, ``build_optimizer``, the config's loss) and step
  (``train_step``, inside the byte tracker's ``track_step`` and the activation-offloading context, as
  ``TrainingSession.train_step`` does) on random packed batches of ``batch_size`` x ``max_seq_len`` tokens, two
  documents a row (or the case's ``document_tokens``) with their longest as the collator says it, every token
  trained. ``plan_check``'s tracker counts the first steps when the case is eager (as in a run); the timed
  steps come after ``warmup`` steps, synchronised, and tokens/s = tokens per step / the median step time.
- ``head_to_head``: ``benchmarks/torchtune_head_to_head.py`` (one harness, CPU and GPU) with the case's shape:
  both libraries' own recipes, interleaved, in their own processes.
- ``fit``: ``mtune plan --fit --device-memory SIZE`` picks the config, which then runs as ``run`` under
  ``torch.cuda.set_per_process_memory_fraction(SIZE / the card's memory)``.
- ``longest_context``: the planner finds the longest ``max_seq_len`` (of ``--context-lengths``) whose plan fits the
  card; that runs as ``run``.
- ``oom_recovery``: ``mtune run`` itself, held by ``device_memory_limit`` to 75% of what the config's plan needs, on
  a synthetic instruction set: the run must re-plan and finish its steps with the same samples per step.

A case whose config keys are not in its recipe's schema yet is a pending feature: it is skipped with that reason.

Each row (see docs/benchmarks.md, "GPU suite"): case, part, kind, compile, gpu_name, versions, expandable_segments,
tokens_per_s, mfu, hfu (mtune's FLOPs count of the batch, as a run counts it, over its ``attention_len``, against
the datasheet peak of the card by its name; rows before 2026-11-27 counted attention over the row),
planned_allocated_gib
(``plan_memory`` for the same config), max_allocated_gib, max_reserved_gib, modelled_margin_gib and
modelled_held_margin_gib (the caching allocator's margin as ``allocator_margin.py`` models it from the plan
without a limit; the smallest budget it serves the plan in, less the plan's peak), alloc_retries and
syncs_all_streams (how often, over the timed steps, the allocator returned its free segments to retry a request,
and waited for every stream; ``torch.cuda.memory_stats``), segments_expandable (the segments' own flag,
``torch.cuda.memory_snapshot``), held_to_gib (part 16's rows: the allocator's limit, ``fit_margin_limit``; such a row
refused is ``status: out_of_memory``, its counts then over the whole process), trace_* and model_* (traced rows:
``allocator_margin.model_on_trace`` over the allocator's own history of the run), device_used_gib (``mem_get_info``:
managed memory included), measured_tensor_gib (the tracker's peak, eager rows), attention_kernel (from the profiler's
op and kernel names), profile_top_cpu / profile_top_device (the profiled step's costliest ops), and on
head-to-head rows torchtune_tokens_per_s, torchtune_max_allocated_gib. CUDA-only figures are null on a CPU. Rows
are appended to ``--out`` and the markdown table beside it is rewritten.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "gpu_suite.json"
STACK_DUMP_S = 60  # a GPU case writes every thread's stack to its log this often (faulthandler)
PART_BUDGET_S = 8 * 60


def allocator_model():
    """``benchmarks/allocator_margin.py``, the caching-allocator model, imported from beside this script."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import allocator_margin

    return allocator_margin


def modelled_margins(events: list, gib: int) -> dict:
    """``benchmarks/allocator_margin.py``'s caching-allocator model over a plan's device events, beside the row's
    measured margin: max reserved − max allocated without a limit (``modelled_margin_gib``), and the smallest
    budget that serves the events less the plan's peak (``modelled_held_margin_gib``: what a fit's margin must
    cover)."""
    model = allocator_model()
    free, held = model.replay(events), model.smallest_budget(events)
    return {"modelled_margin_gib": (free.max_reserved - free.max_allocated) / gib,
            "modelled_held_margin_gib": (held.limit - held.max_requested) / gib}


def fit_margin_limit(api, plan) -> int:
    """Bytes the caching allocator may reserve in the tightest device budget ``mtune plan --fit`` accepts for
    ``plan``: the smallest budget B with the plan's device total plus ``allocator_margin(B)`` within B, less what
    the plan counts outside the allocator (the CUDA context, managed memory kept resident)."""
    total = plan.device_total_bytes
    budget = total + api.allocator_margin(total)
    while total + api.allocator_margin(budget) > budget:  # the margin grows with the budget (a share of it)
        budget = total + api.allocator_margin(budget)
    return budget - (total - plan.device_peak_bytes)


def mtune_api() -> SimpleNamespace:
    """Every mtune name the suite uses, imported here and nowhere else (packages are being restructured: when a
    name moves, this is the one place to update)."""
    sys.path.insert(0, str(REPO))
    from mtune._cli.catalog import find_config, find_recipe, load_recipe_module
    from mtune._cli.main import main as cli_main
    from mtune._cli.run import load_and_check
    from mtune.models import FAMILIES
    from mtune.modules.loss import ChunkedCrossEntropyLoss
    from mtune.training.context import setup_run
    from mtune.training.loop import build_loss, train_step
    from mtune.training.optimizers import build_optimizer, inner_optimizers
    from mtune.training.memory.registry import MemoryConfig
    from mtune.training.model_setup import resolve_model_source, setup_model
    from mtune.training.observe.flops import StepFlops
    from mtune.training.observe.memory_stats import saved_for_backward_bytes
    from mtune.training.observe.peak_flops import gpu_peak_flops, peak_flops
    from mtune.training.planning.breakdown import MemoryBreakdown
    from mtune.training.planning.fit import allocator_margin
    from mtune.training.planning.memory_plan import CUDA_CONTEXT_BYTES
    from mtune.training.planning.plan import plan_memory
    from mtune.training.planning.tracker import device_events
    from mtune.units import GIB

    return SimpleNamespace(**{k: v for k, v in locals().items()})


# ------------------------------------------------------------------------------------------------ the cases
@dataclass(frozen=True)
class Case:
    """One row of the suite. ``overrides`` are ``key=value`` config overrides on top of ``config``."""

    name: str
    part: int
    config: str
    recipe: str
    what: str
    overrides: tuple[str, ...] = ()
    kind: str = "run"  # run | head_to_head | fit | longest_context | oom_recovery | preference
    compile: bool = False
    batch_size: int = 4
    seq_len: int = 2048
    steps: int = 8  # timed steps after warmup
    warmup: int = 3  # compile, first touch, plan_check's tracked steps
    needs: tuple[str, ...] = ()  # config keys the case sets that other work is adding: pending until they exist
    pending: str = ""  # what the case waits for, said when it is skipped
    fla: bool = False  # run with flash-linear-attention importable (--fla-path): Gated DeltaNet on its kernels
    torchao_dequantize: bool = False  # NF4 dequantized by torchao's eager ops, not the compiled kernel (its twin)
    experts_by_parts: bool = False  # NF4 expert stacks dequantized an eighth at a time, as before 2026-11-27 (twin)
    # speed only: flash-linear-attention's guard against its wrong gated backward on Hopper with Triton 3.4-3.7.0
    # (its #640) lifted, to time its kernels where no correct configuration can be carried (docs/benchmarks.md)
    fla_guard_lifted: bool = False
    env: tuple[tuple[str, str], ...] = ()  # environment of the case's process (e.g. TORCH_LOGS for its log)
    device_memory_gib: float | None = None  # fit: the budget --fit plans for and the run is held to
    # run under the allocator limit of the tightest budget --fit would accept for the case's plan (fit_margin_limit)
    held_to_fit_margin: bool = False
    document_tokens: int | None = None  # packed rows of documents this long (and the rest); None: two a row
    row_bound: bool = False  # the varlen kernel bounded by the row, not the batch's longest document (its twin)
    # record the allocator's history from setup on and replay it through allocator_margin.py's model (CUDA only;
    # the recording costs a few microseconds an allocation, so such a row's speed is not a speed figure)
    trace_allocator: bool = False
    # GPU minutes the case is expected to take (machine start excluded): a measured case's wall time on the H100 of
    # the second lease (gpu_suite.json's wall_s) plus a quarter, in quarter minutes; the others by their nearest
    # measured kin, or larger where they plan or build more (the 30B MoE, the host optimizer, the longest context)
    minutes: float = 1.0


def _model(family: str, size: str) -> tuple[str, ...]:
    return ("model.checkpoint_dir=null", f"model.family={family}", f"model.size={size}")


L1B, L3B, L8B = _model("llama3_2", "1B"), _model("llama3_2", "3B"), _model("llama3_1", "8B")
COMPILE_LOGS = (("TORCH_LOGS", "graph_breaks,recompiles"),)  # what dynamo split and recompiled, into the case's log
LORA_RUN = ("gradient_accumulation_steps=1", "clip_grad_norm=null")

CASES: list[Case] = [
    # ---- parts 1 and 2: the "part 1", the rows that matter most (two commands of <= 8 minutes: with the
    # machine's start, <= 25 GPU minutes)
    Case("llama3_2_1B_lora_compiled", 1, "llama3_2/1B_lora_single_device", "lora_single_device",
         "1B LoRA, compiled, packed 2048 x 4", L1B + LORA_RUN, compile=True, minutes=0.75),
    Case("llama3_1_8B_lora_compiled_packed4096", 1, "llama3_1/8B_lora_single_device", "lora_single_device",
         "8B LoRA, compiled, packed 4096 x 2", L8B + LORA_RUN, compile=True, batch_size=2, seq_len=4096,
         minutes=1),
    Case("llama3_1_8B_qlora_compiled_packed4096", 1, "llama3_1/8B_qlora_single_device", "lora_single_device",
         "8B QLoRA (NF4 base), compiled, packed 4096 x 2", L8B + LORA_RUN, compile=True, batch_size=2,
         seq_len=4096, env=COMPILE_LOGS, minutes=1.25),
    Case("llama3_1_8B_full_low_memory", 2, "llama3_1/8B_full_single_device_low_memory", "full_single_device",
         "8B full, low-memory flags (paged AdamW8bit in backward, checkpointing), packed 2048 x 2", L8B,
         batch_size=2, minutes=0.75),
    Case("llama3_2_3B_lora_head_to_head", 2, "llama3_2/3B_lora_single_device", "lora_single_device",
         "3B-shaped LoRA, both libraries compiled, packed 2048 x 4", kind="head_to_head", compile=True, steps=9,
         minutes=3.0),  # the fifth lease's 138 s, plus the parity step's two eager runs (estimated)
    # ---- part 3: eager twins of part 1, and the 3B full fine-tune
    Case("llama3_2_1B_lora_eager", 3, "llama3_2/1B_lora_single_device", "lora_single_device",
         "1B LoRA, eager, packed 2048 x 4", L1B + LORA_RUN, minutes=0.5),
    Case("llama3_1_8B_lora_eager_packed4096", 3, "llama3_1/8B_lora_single_device", "lora_single_device",
         "8B LoRA, eager, packed 4096 x 2", L8B + LORA_RUN, batch_size=2, seq_len=4096, minutes=0.75),
    Case("llama3_1_8B_qlora_eager_packed4096", 3, "llama3_1/8B_qlora_single_device", "lora_single_device",
         "8B QLoRA, eager, packed 4096 x 2", L8B + LORA_RUN, batch_size=2, seq_len=4096, minutes=1.25),
    Case("llama3_2_3B_full_compiled", 3, "llama3_2/3B_full_single_device", "full_single_device",
         "3B full, AdamW, compiled, packed 2048 x 2", L3B + ("gradient_accumulation_steps=1",), compile=True,
         batch_size=2, minutes=0.75),
    # ---- parts 4-6: the 8B full fine-tune in AdamW, the offloading techniques, fp8 storage
    Case("llama3_1_8B_full_compiled", 4, "llama3_1/8B_full_single_device", "full_single_device",
         "8B full, AdamW (bf16 states), compiled, packed 2048 x 1", L8B + ("gradient_accumulation_steps=1",),
         compile=True, batch_size=1, minutes=0.75),
    Case("llama3_1_8B_lora_activation_offloading", 4, "llama3_1/8B_lora_single_device", "lora_single_device",
         "8B LoRA, checkpointing + activation offloading with streams, packed 4096 x 2",
         L8B + LORA_RUN + ("enable_activation_offloading=true", "activation_offloading_use_streams=true"),
         batch_size=2, seq_len=4096, minutes=0.75),
    Case("llama3_1_8B_lora_weight_offloading_block", 4, "llama3_1/8B_lora_single_device", "lora_single_device",
         "8B LoRA, block-level weight offloading with streams, packed 4096 x 2",
         L8B + LORA_RUN + ("weight_offloading={type: block_level, blocks_per_group: 1, use_streams: true}",),
         batch_size=2, seq_len=4096, minutes=1),
    Case("llama3_1_8B_lora_weight_offloading_leaf", 5, "llama3_1/8B_lora_single_device", "lora_single_device",
         "8B LoRA, leaf-level weight offloading with streams, packed 4096 x 2",
         L8B + LORA_RUN + ("weight_offloading={type: leaf_level, blocks_per_group: 1, use_streams: true}",),
         batch_size=2, seq_len=4096, steps=4, minutes=1),
    Case("llama3_1_8B_full_optimizer_offload", 5, "llama3_1/8B_full_single_device", "full_single_device",
         "8B full, AdamW states in host memory (optimizer_offload=cpu), checkpointing, packed 2048 x 1",
         L8B + ("gradient_accumulation_steps=1", "optimizer_offload=cpu", "clip_grad_norm=null",
                "enable_activation_checkpointing=true"), batch_size=1, steps=4, warmup=2, minutes=3.0),
    Case("llama3_1_8B_full_paged_adamw8bit", 5, "llama3_1/8B_full_single_device", "full_single_device",
         "8B full, PagedAdamW8bit (residency: mem_get_info), checkpointing, packed 2048 x 1",
         L8B + ("gradient_accumulation_steps=1", "optimizer._component_=bitsandbytes.optim.PagedAdamW8bit",
                "enable_activation_checkpointing=true"), batch_size=1, minutes=0.75),
    Case("llama3_1_8B_lora_fp8_storage", 6, "llama3_1/8B_lora_single_device", "lora_single_device",
         "8B LoRA, frozen block linears stored in float8_e4m3fn, packed 4096 x 2",
         L8B + LORA_RUN + ("weight_storage_dtype=float8_e4m3fn",), batch_size=2, seq_len=4096, minutes=1),
    # --fit's 8B answers, held to the budget they were fitted for
    Case("llama3_1_8B_lora_fit_24GiB", 6, "llama3_1/8B_lora_single_device", "lora_single_device",
         "8B LoRA as `mtune plan --fit --device-memory 24GiB` configures it, under a 24 GiB memory fraction",
         L8B + LORA_RUN, kind="fit", device_memory_gib=24, minutes=1.5),
    Case("llama3_1_8B_full_fit_40GiB", 6, "llama3_1/8B_full_single_device", "full_single_device",
         "8B full as `mtune plan --fit --device-memory 40GiB` configures it, under a 40 GiB memory fraction",
         L8B + ("gradient_accumulation_steps=1",), kind="fit", device_memory_gib=40, batch_size=2, minutes=2),
    # ---- part 7: the longest context the planner says fits, and the packed kernel the long-context work adds
    Case("llama3_1_8B_lora_longest_planned_context", 7, "llama3_1/8B_lora_single_device", "lora_single_device",
         "8B LoRA, batch 1, checkpointing + activation offloading, the longest max_seq_len planned to fit",
         L8B + LORA_RUN + ("enable_activation_offloading=true",), kind="longest_context", batch_size=1, steps=3,
         warmup=2, minutes=4.0),
    Case("llama3_1_8B_lora_packed4096_segments", 7, "llama3_1/8B_lora_single_device", "lora_single_device",
         "8B LoRA, compiled, packed 4096 x 2, attention per document from its boundaries (varlen flash on CUDA)",
         L8B + LORA_RUN + ("attention_kernel=segments",), compile=True, batch_size=2, seq_len=4096,
         needs=("attention_kernel",), minutes=1),
    # ---- part 8: why 8B QLoRA compiled allocated 40.73 GiB where its eager twin allocated 9.89 (H100, 2026-11-26).
    # Run with part 1's QLoRA case again (now with saved_for_backward_gib): without checkpointing (the same peak
    # would mean the compiled blocks never recompute), and with the dense mask (no graph break at the varlen kernel)
    Case("llama3_1_8B_qlora_compiled_no_checkpointing", 8, "llama3_1/8B_qlora_single_device", "lora_single_device",
         "8B QLoRA, compiled, activation checkpointing off, packed 4096 x 2",
         L8B + LORA_RUN + ("enable_activation_checkpointing=false",), compile=True, batch_size=2, seq_len=4096,
         steps=4, env=COMPILE_LOGS, minutes=1.0),
    Case("llama3_1_8B_qlora_compiled_dense_mask", 8, "llama3_1/8B_qlora_single_device", "lora_single_device",
         "8B QLoRA, compiled, attention_kernel=dense_mask (no graph break in the block), packed 4096 x 2",
         L8B + LORA_RUN + ("attention_kernel=dense_mask",), compile=True, batch_size=2, seq_len=4096, steps=4,
         env=COMPILE_LOGS, minutes=1.0),
    Case("llama3_1_8B_lora_compiled_dense_mask", 8, "llama3_1/8B_lora_single_device", "lora_single_device",
         "8B LoRA, compiled, attention_kernel=dense_mask, packed 4096 x 2 (the varlen kernel's gain, against part 1)",
         L8B + LORA_RUN + ("attention_kernel=dense_mask",), compile=True, batch_size=2, seq_len=4096, steps=4,
         env=COMPILE_LOGS, minutes=1.0),
    # ---- part 9: the 2025-2026 families (random weights by family and size, as above)
    Case("qwen3_8B_lora_compiled_packed4096", 9, "qwen3/8B_lora_single_device", "lora_single_device",
         "Qwen3 8B LoRA, compiled, packed 4096 x 2", _model("qwen3", "8B") + LORA_RUN, compile=True,
         batch_size=2, seq_len=4096, minutes=1.25),
    Case("qwen3_moe_30B_A3B_qlora_packed4096", 9, "qwen3_moe/30B_A3B_qlora_single_device", "lora_single_device",
         "Qwen3-30B-A3B QLoRA (NF4 experts), eager, packed 4096 x 1", _model("qwen3_moe", "30B_A3B") + LORA_RUN,
         batch_size=1, seq_len=4096, steps=10, minutes=2.5),  # 10 steps: its step times spread 2.3-3.3 s over 4
    Case("qwen3_5_9B_lora_packed4096", 9, "qwen3_5/9B_lora_single_device", "lora_single_device",
         "Qwen3.5 9B LoRA, eager, Gated DeltaNet in PyTorch (no linear-attention kernels carried), packed 4096 x 1",
         _model("qwen3_5", "9B") + LORA_RUN, batch_size=1, seq_len=4096, steps=4, minutes=1.5),
    Case("qwen3_5_9B_lora_fla_packed4096", 9, "qwen3_5/9B_lora_single_device", "lora_single_device",
         "Qwen3.5 9B LoRA, eager, Gated DeltaNet on flash-linear-attention's kernel, packed 4096 x 1",
         _model("qwen3_5", "9B") + LORA_RUN, batch_size=1, seq_len=4096, steps=4, fla=True, minutes=2.0),
    # ---- part 11: the 2026 families' GPU row beside Qwen3.5's (part 9), gpt-oss; MoE adapters on the experts
    Case("qwen3_moe_30B_A3B_qlora_expert_lora_packed4096", 11, "qwen3_moe/30B_A3B_qlora_single_device",
         "lora_single_device", "Qwen3-30B-A3B QLoRA, adapters on every expert too (grouped), eager, packed 4096 x 1",
         _model("qwen3_moe", "30B_A3B") + LORA_RUN
         + ("lora.modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]",),
         batch_size=1, seq_len=4096, steps=4, minutes=2.0),
    Case("gpt_oss_20B_lora_packed4096", 11, "gpt_oss/20B_lora_single_device", "lora_single_device",
         "gpt-oss 20B LoRA, eager, bf16 experts, attention sinks (packed rows per segment), packed 4096 x 1",
         _model("gpt_oss", "20B") + LORA_RUN, batch_size=1, seq_len=4096, steps=4, minutes=1.5),
    # ---- part 10: the fit issue's GPU check: a run whose config needs more than device_memory_limit recovers
    Case("llama3_1_8B_lora_oom_recovery", 10, "llama3_1/8B_lora_single_device", "lora_single_device",
         "8B LoRA without checkpointing, packed 4096 x 4, held to 75% of its planned peak: oom_recovery re-plans",
         L8B + LORA_RUN + ("enable_activation_checkpointing=false",), kind="oom_recovery", batch_size=4,
         seq_len=4096, steps=4, warmup=2, minutes=1.5),
    # ---- part 12: NF4 dequantized by one compiled kernel on CUDA (mtune/modules/nf4_dequantize.py) against
    # torchao's eager ops, the code it replaced, in one call: eager 8B QLoRA and the 30B MoE (experts dequantized
    # three times a step); their twins without the _torchao_dequantize suffix are part 3's and part 9's cases
    Case("llama3_1_8B_qlora_eager_torchao_dequantize_packed4096", 12, "llama3_1/8B_qlora_single_device",
         "lora_single_device", "8B QLoRA, eager, packed 4096 x 2, NF4 dequantized by torchao's eager ops",
         L8B + LORA_RUN, batch_size=2, seq_len=4096, torchao_dequantize=True, minutes=1.25),
    Case("qwen3_moe_30B_A3B_qlora_torchao_dequantize_packed4096", 12, "qwen3_moe/30B_A3B_qlora_single_device",
         "lora_single_device", "Qwen3-30B-A3B QLoRA, eager, packed 4096 x 1, NF4 dequantized by torchao's eager ops",
         _model("qwen3_moe", "30B_A3B") + LORA_RUN, batch_size=1, seq_len=4096, steps=10, torchao_dequantize=True,
         minutes=2.5),
    # ---- part 13: Qwen3.5's linear attention made faster two ways, beside part 9's eager PyTorch-form row: fla-core's
    # kernels, timed where it refuses them (Hopper, Triton 3.4-3.7.0) with its guard lifted for speed only (the
    # gradients are wrong there), and the PyTorch form compiled
    Case("qwen3_5_9B_lora_fla_speed_only_packed4096", 13, "qwen3_5/9B_lora_single_device", "lora_single_device",
         "Qwen3.5 9B LoRA, eager, flash-linear-attention's kernel, its Hopper guard lifted (speed only), 4096 x 1",
         _model("qwen3_5", "9B") + LORA_RUN, batch_size=1, seq_len=4096, steps=4, fla=True, fla_guard_lifted=True,
         minutes=2.0),
    Case("qwen3_5_9B_lora_compiled_packed4096", 13, "qwen3_5/9B_lora_single_device", "lora_single_device",
         "Qwen3.5 9B LoRA, compiled (Gated DeltaNet's PyTorch form compiled with its blocks), packed 4096 x 1",
         _model("qwen3_5", "9B") + LORA_RUN, compile=True, batch_size=1, seq_len=4096, steps=4, minutes=2.5),
    # ---- part 15: compile where no row has measured it: the MoE QLoRA step (routing, grouped expert matmuls, each
    # NF4 expert projection dequantized whole under compile), with part 9's eager twin in the same lease
    Case("qwen3_moe_30B_A3B_qlora_compiled_packed4096", 15, "qwen3_moe/30B_A3B_qlora_single_device",
         "lora_single_device", "Qwen3-30B-A3B QLoRA (NF4 experts), compiled, packed 4096 x 1",
         _model("qwen3_moe", "30B_A3B") + LORA_RUN, compile=True, batch_size=1, seq_len=4096, steps=10,
         env=COMPILE_LOGS, minutes=3.0),
    # ---- part 14: DPO of 8B LoRA with each reference choice, `mtune run` itself on the tiny task's pairs packed
    # into full rows of 2 x 1024 tokens, 2 rows a step (plan_check's 3 tracked steps are the warm-up)
    *(Case(f"llama3_1_8B_lora_dpo_{reference}", 14, "llama3_1/8B_lora_dpo_single_device", "lora_dpo_single_device",
           f"8B LoRA DPO, reference={reference}, eager, packed pairs in rows of 2 x 1024, 2 rows a step",
           L8B + ("gradient_accumulation_steps=1", f"reference={reference}"), kind="preference", batch_size=2,
           seq_len=1024, steps=5, warmup=3, minutes=minutes)
      for reference, minutes in (("adapters_off", 1.5), ("precomputed", 2.0), ("copy", 1.75))),
]
# ---- part 16: --fit's allocator margin, max(1 GiB, 5%), under pressure, each row held to the limit that the tightest
# budget --fit would accept for its plan leaves the allocator (fit_margin_limit): the two rows whose unlimited runs
# reserved the most beyond what they allocated (6.34 and 2.06 GiB, the fifth and fourth leases: gradients and saved
# tensors waiting for a side stream's copies, `record_stream`), which the allocator model held to a limit serves
# within 0.28 and 0.54 GiB over their plans; QLoRA's default CUDA step, whose compiled NF4 kernel allocates outside
# the plan (1.23 GiB measured, 0.74 modelled); block-level weight offloading, where the model's 0.91 GiB and the run's
# 0.09 GiB over its plan leave the margin 0.01 GiB short; and torchao's eager dequantization (1.66 GiB: 0.76 short)
# (PyTorch's default allocator, pinned since mtune asks for expandable segments: the allocator model's, whose
# replay of the run's history the row sets beside it)
CASES += [replace(twin, name=f"{twin.name}_held_to_fit_margin", part=16, held_to_fit_margin=True,
                  env=twin.env + (("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False"),),
                  trace_allocator=True, what=f"{twin.what}, held to --fit's allocator margin over its plan")
          for twin in CASES if twin.name in ("llama3_1_8B_full_optimizer_offload",
                                             "llama3_1_8B_lora_activation_offloading",
                                             "llama3_1_8B_qlora_eager_packed4096",
                                             "llama3_1_8B_lora_weight_offloading_block",
                                             "llama3_1_8B_qlora_eager_torchao_dequantize_packed4096")]
# ---- part 17: part 16's rows again with expandable segments, which map pages into one growing segment per stream
# instead of carving fixed ones: whether the fragmentation that refused two of them at that limit (the sixth lease,
# 2026-11-27: ~1 GiB reserved but unallocated) goes. The allocator model knows only fixed segments, so no trace is
# replayed. The seventh lease saw those two train; mtune has asked for expandable segments on CUDA since
# (mtune.training.context.configure_cuda_allocator), so every other case runs with them unless its env says not
CASES += [replace(held, name=held.name.replace("_held_to_fit_margin", "_expandable_held_to_fit_margin"), part=17,
                  env=tuple(kv for kv in held.env if kv[0] != "PYTORCH_CUDA_ALLOC_CONF")
                  + (("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),), trace_allocator=False,
                  what=f"{held.what}, with expandable segments")
          for held in CASES if held.part == 16]
# ---- part 18: the varlen call's bound from the batch's longest document (2026-11-27) against the row length it
# replaced, in one lease: the 3B LoRA step compiled, packed 2048 x 4 of 96-token documents (the head-to-head
# fixture's instruct rows average 85.9 tokens, 121 at most), 21 documents and a 32-token tail a row
CASES += [Case(f"llama3_2_3B_lora_compiled_short_documents{suffix}", 18, "llama3_2/3B_lora_single_device",
               "lora_single_device", f"3B LoRA, compiled, packed 2048 x 4 of 96-token documents, {bound}",
               L3B + LORA_RUN, compile=True, document_tokens=96, row_bound=row_bound, minutes=1.0)
          for suffix, row_bound, bound in (("", False, "varlen bounded by the longest document"),
                                           ("_row_bound", True, "varlen bounded by the row, as before"))]
# ---- part 19: the MFU row with the flags --fit picks for the card (the shipped config checkpoints every
# block for 24 GiB cards; on an H100 --fit turns checkpointing off and takes the unchunked loss, 63.68 GiB planned on
# this CPU, 2026-11-27), compiled as part 1's row
CASES += [Case("llama3_1_8B_lora_compiled_fit_78GiB", 19, "llama3_1/8B_lora_single_device", "lora_single_device",
               "8B LoRA, compiled, as `mtune plan --fit --device-memory 78GiB` configures it, packed 4096 x 2",
               L8B + LORA_RUN + ("compile=true",), kind="fit", compile=True, device_memory_gib=78, batch_size=2,
               seq_len=4096, minutes=1.5)]
# ---- part 20: the NF4 expert stacks dequantized whole where the kernel dequantizes (2026-11-27) against by eighths,
# the code it replaced (each eighth decoded, then copied into the stack: 4,145 device copies in the seventh lease's
# profiled step), beside part 9's row in one lease
CASES += [replace(next(c for c in CASES if c.name == "qwen3_moe_30B_A3B_qlora_packed4096"),
                  name="qwen3_moe_30B_A3B_qlora_experts_by_parts_packed4096", part=20, experts_by_parts=True,
                  what="Qwen3-30B-A3B QLoRA, eager, packed 4096 x 1, NF4 expert stacks dequantized by eighths")]

DRY_RUN = dict(family="tiny", size="tiny", batch_size=2, seq_len=64, steps=2, warmup=1, context_lengths=(64, 128, 256),
               device_memory_gib=1.05, head_to_head_seq=128)  # --fit keeps at least 1 GiB of allocator margin
"""What --dry-run changes: the case's family at its ``tiny`` size, so the dry run runs the case's own kinds of layer
(the ``tiny`` family, NF4-friendly shapes and a vocabulary of 512, for a case that names no family), 2 x 64 tokens,
one warm-up and two timed steps; the fit budget and context lengths scaled to it."""


def select(part: int | None, names: list[str] | None) -> list[Case]:
    """The cases of ``part`` (every part when None), or only ``names``, in the order named (the first named runs
    first: a short lease measures what matters most)."""
    cases = [c for c in CASES if part is None or c.part == part]
    if names:
        cases = sorted((c for c in cases if c.name in names), key=lambda c: names.index(c.name))
    unknown = set(names or ()) - {c.name for c in CASES}
    if unknown:
        raise SystemExit(f"unknown case(s): {', '.join(sorted(unknown))}; --list shows them")
    return cases


# ------------------------------------------------------------------------------------------------ environment
def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(api) -> dict:
    """What a row was measured on: the card, the versions, the allocator setting."""
    import torch

    cuda = torch.cuda.is_available()
    driver = None
    if cuda:
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            driver = None
    return {
        "gpu_name": torch.cuda.get_device_name() if cuda else None,
        "gpu_memory_gib": torch.cuda.get_device_properties(0).total_memory / api.GIB if cuda else None,
        "python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda, "driver": driver,
        "torchao": _version("torchao"), "bitsandbytes": _version("bitsandbytes"), "torchtune": _version("torchtune"),
        "expandable_segments": expandable_segments_asked(),
    }


def expandable_segments_asked() -> bool:
    """Whether this process's run asks for expandable segments: as ``PYTORCH_CUDA_ALLOC_CONF`` (or
    ``PYTORCH_ALLOC_CONF``) says where set, else mtune's default (``configure_cuda_allocator``: yes). Rows before
    the seventh lease ran with PyTorch's default wherever the variable was unset, and say false."""
    from mtune.training.context import users_allocator_settings

    users = users_allocator_settings()
    return True if users is None else "expandable_segments:true" in users[1].lower()


# ------------------------------------------------------------------------------------------------ one run
def case_config(api, case: Case, *, device: str, dry_run: bool, seq_len: int | None = None, extra=(),
                config_path: str | None = None):
    """The case's config, checked against its recipe's schema with the defaults filled in, as `mtune run` loads
    it. Returns ``(cfg, missing keys)``: keys the case needs that the recipe does not declare yet."""
    module = api.load_recipe_module(api.find_recipe(case.recipe))
    missing = [k for k in case.needs if k not in module.SCHEMA.keys]
    if missing:
        return None, missing
    overrides = list(case.overrides)
    if dry_run:  # the case's family at its tiny size (its own layers: MoE, DeltaNet, sinks), else the tiny family
        family = next((o.split("=", 1)[1] for o in overrides if o.startswith("model.family=")), None)
        if DRY_RUN["size"] not in api.FAMILIES.get(family, (None, {}))[1]:
            family = DRY_RUN["family"]
        overrides = [o for o in overrides if not o.startswith(("model.family=", "model.size="))]
        overrides += [f"model.family={family}", f"model.size={DRY_RUN['size']}"]
    seq = seq_len or (DRY_RUN["seq_len"] if dry_run else case.seq_len)
    batch = DRY_RUN["batch_size"] if dry_run else case.batch_size
    overrides += [f"device={device}", "dtype=bf16", f"compile={str(case.compile).lower()}",
                  f"batch_size={batch}", f"tokenizer.max_seq_len={seq}", "dataset.packed=true",
                  "tokenizer.path=null", "overwrite_output_dir=true", *extra]
    if config_path is None and dry_run and "model.checkpoint_dir=null" not in overrides:
        overrides.append("model.checkpoint_dir=null")
    return api.load_and_check(module, api.find_config(config_path or case.config), overrides), []


def fitted_config(api, case: Case, path: Path):
    """The config `mtune plan --fit` wrote for ``case``, as written: its batch size, accumulation and techniques are
    the answer (the case's own overrides went into the search; applied again, they undid it)."""
    module = api.load_recipe_module(api.find_recipe(case.recipe))
    return api.load_and_check(module, api.find_config(str(path)), ["overwrite_output_dir=true"])


def synthetic_batch(batch_size: int, seq_len: int, vocab_size: int, generator, document_tokens: int | None = None,
                    row_bound: bool = False) -> dict:
    """A packed batch as the collator makes it (positions restart, document ids, the longest document), every token
    trained: two documents per row, or documents of ``document_tokens`` and the rest of the row one more.
    ``row_bound``: no ``longest_document``, so the varlen kernel is bounded by the row, as before 2026-11-27."""
    import torch

    lengths = ([seq_len // 2, seq_len - seq_len // 2] if document_tokens is None else
               [document_tokens] * (seq_len // document_tokens) + [seq_len % document_tokens])
    lengths = [n for n in lengths if n]
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
    labels = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
    input_pos = torch.cat([torch.arange(n) for n in lengths]).expand(batch_size, -1).contiguous()
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    batch = {"tokens": tokens, "labels": labels, "input_pos": input_pos,
             "document_ids": document_ids.expand(batch_size, -1).contiguous()}
    return batch if row_bound else {**batch, "longest_document": max(lengths)}


def batch_flops(step_flops, batch: dict):
    """``(FLOPs per token, attention length)`` of ``batch`` as a run counts them (``StepFlops``): the attention
    length its packed documents' ``sum(L²) / sum(L)`` under the segment kernels, the row under the dense mask."""
    s = int(batch["tokens"].shape[-1])
    attention_len = step_flops.attention_len(batch)
    return step_flops.per_token(s, batch["tokens"].numel(), attention_len), attention_len or float(s)


ATTENTION_KERNELS = (("flex_attention", "flex"), ("flash_attention_for_cpu", "flash_cpu"), ("flash", "flash"),
                     ("efficient_attention", "mem_efficient"), ("cudnn_attention", "cudnn"),
                     ("_scaled_dot_product_attention_math", "math"))
"""Substrings of op and kernel names (the first that a name holds decides) and the kernel they mean."""


PROFILE_TOP = 12
"""How many ops of the profiled step a row names, by their own time on the host and on the device."""


def profile_top(prof, cuda: bool, sites: bool = True) -> dict:
    """The profiled step's costliest ops: ``profile_top_cpu`` (and ``profile_top_device`` on CUDA), each
    ``"op: total ms (calls)"`` by the op's self time, the largest first: where a step's time goes. With ``sites``,
    ``profile_top_sites`` too: the same time (the device's on CUDA) by the innermost mtune function the ops ran in,
    ``"mtune/modules/expert_linear.py(107): stacked: total ms (ops)"`` (the line where the function starts): who
    owns it (the profile records Python stacks)."""
    averages = [e for e in prof.key_averages() if not _python_frame(e.key)]
    fields = {"profile_top_cpu": "self_cpu_time_total"}
    if cuda:
        fields["profile_top_device"] = "self_device_time_total"
    top = {key: [f"{e.key}: {getattr(e, field) / 1e3:.2f} ms ({e.count})"
                 for e in sorted(averages, key=lambda e: -getattr(e, field))[:PROFILE_TOP]]
           for key, field in fields.items()}
    if not sites:
        return top
    field = fields["profile_top_device" if cuda else "profile_top_cpu"]
    by_site: dict[str, list] = {}
    # what the attribution saw, by event kind: the first lease to record sites (2026-11-27) put every op of every row
    # "(outside mtune)", which the CPU's profile never does; these counts say which events lacked a Python frame
    seen = {"python_frames": 0, "timed_events": {}, "timed_with_python_parent": {}}
    for event in prof.events():
        if _python_frame(event.name):
            seen["python_frames"] += 1
            continue
        if not getattr(event, field):
            continue
        kind = str(getattr(event, "device_type", "?")).rsplit(".", 1)[-1]
        seen["timed_events"][kind] = seen["timed_events"].get(kind, 0) + 1
        parents = list(_ancestors(event.cpu_parent))
        if any(_python_frame(p.name) for p in parents):
            seen["timed_with_python_parent"][kind] = seen["timed_with_python_parent"].get(kind, 0) + 1
        owner = next((p.name for p in parents if "mtune/" in p.name), None)
        site = by_site.setdefault("(outside mtune)" if owner is None else "mtune/" + owner.split("mtune/", 1)[1],
                                  [0.0, 0])
        site[0] += getattr(event, field)
        site[1] += 1
    top["profile_top_sites"] = [f"{name}: {total / 1e3:.2f} ms ({ops})" for name, (total, ops)
                                in sorted(by_site.items(), key=lambda item: -item[1][0])[:PROFILE_TOP]]
    top["profile_site_events"] = seen
    return top


def _ancestors(event):
    """``event`` and its CPU parents, innermost first."""
    while event is not None:
        yield event
        event = event.cpu_parent


def dynamo_limits_hit() -> int:
    """How often this process's torch.compile gave up on a function at dynamo's recompile limit (it then runs
    eagerly, or raises under ``fullgraph``): a compiled kernel that silently stopped compiling shows here."""
    from torch._dynamo.utils import counters

    return sum(n for reason, n in counters["unimplemented"].items()
               if "recompile limit" in reason.lower() or "cache_size_limit" in reason.lower())


def _python_frame(name: str) -> bool:
    """Whether a profiler event is a Python frame (``with_stack``), not an op."""
    return ".py(" in name or name.startswith("<built-in")


def attention_kernel(names: set[str]) -> str | None:
    """The attention kernel that ran, from the profiler's op and kernel names of one step (``a+b`` when both)."""
    found = []
    for name in sorted(names):
        kind = next((kind for needle, kind in ATTENTION_KERNELS if needle in name.lower()), None)
        if kind and kind not in found:
            found.append(kind)
    if not found and any("scaled_dot_product" in n for n in names):
        found.append("math")  # SDPA ran and no fused kernel did: its composite (math) path
    return "+".join(found) or None


SAVED_GROUPS_KEPT = 8
"""``saved_for_backward_largest`` keeps this many (shape, dtype) groups, the largest first."""


TRACE_MAX_ENTRIES = 4_000_000
"""The most allocator history entries a traced row keeps (an 8B step makes tens of thousands; a row that reaches it
says so: ``trace_entries``)."""


def traced_allocator(api, memory_fraction: float | None, requests: Path) -> dict:
    """Stop recording the allocator's history and set ``allocator_margin.model_on_trace`` beside it (GiB; the
    model held to the row's limit where it had one); the history's requests go to ``requests``
    (``allocator_margin.save_requests``), beside the plan's."""
    import torch

    trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    torch.cuda.memory._record_memory_history(enabled=None)
    events = allocator_model().trace_events(trace)
    allocator_model().save_requests(requests, events)
    limit = None if memory_fraction is None else int(memory_fraction * torch.cuda.get_device_properties(0).total_memory)
    figures = allocator_model().model_on_trace(trace, limit, events)
    return {"trace_entries": len(trace), **dict((f"{k}_gib", v / api.GIB) if k.endswith(("reserved", "allocated"))
                                                else (k, v) for k, v in figures.items())}


def requests_log(workdir: Path, case: Case, which: str) -> Path:
    """Where a traced row's ``plan`` or ``run`` request log goes (gzipped JSON; the lease script packs it)."""
    return workdir / f"{case.name}.{which}.requests.json.gz"


def allocator_counts(cuda: bool) -> dict:
    """The caching allocator's counts of retries after returning its free segments and of waits for every
    stream (``torch.cuda.memory_stats``), and whether its segments are expandable (the segments' own flag in
    ``torch.cuda.memory_snapshot``: what the allocator did, not what the environment asked), or None each off
    CUDA."""
    import torch

    stats = torch.cuda.memory_stats() if cuda else {}
    segments = torch.cuda.memory_snapshot() if cuda and torch.cuda.is_initialized() else []
    return {"alloc_retries": stats.get("num_alloc_retries"), "syncs_all_streams": stats.get("num_sync_all_streams"),
            "segments_expandable": any(s.get("is_expandable") for s in segments) if segments else None}


def run_case(api, case: Case, cfg, *, workdir: Path, memory_fraction: float | None = None,
             row: dict | None = None) -> dict:
    """Set up as the recipes do, step, time, measure. Returns the row's measured fields, filled into ``row`` as
    they are measured (a run that raises leaves there what it measured before)."""
    import torch

    cuda = torch.cuda.is_available() and str(cfg.device).startswith("cuda")
    row = {} if row is None else row
    from mtune.modules import expert_linear, nf4_dequantize

    nf4_dequantize.COMPILED_ON_CUDA = not case.torchao_dequantize  # before the plan, which models the choice
    expert_linear.STACK_WHOLE_WHERE_ALONE = not case.experts_by_parts  # the same
    if case.fla_guard_lifted:  # before setup, whose probe would refuse the kernel: its gradients here are wrong
        import fla.ops.common.chunk_o as chunk_o

        chunk_o.TRITON_ABOVE_3_7_1 = True
        row["fla_guard_lifted"] = ("speed only: fla-core refuses its gated backward on this GPU and Triton (its "
                                   "#640: wrong gradients); lifted to time the kernels, not to train")
    row["nf4_dequantize"] = "torchao eager" if case.torchao_dequantize else "compiled on CUDA"
    row["nf4_expert_stacks"] = "by eighths" if case.experts_by_parts else "whole where the kernel dequantizes"
    plan_cfg = cfg.copy()
    # a CUDA row also logs the plan's device storages: the caching-allocator model's input (allocator_margin.py)
    with api.device_events() if cuda else contextlib.nullcontext() as events:
        plan = api.plan_memory(plan_cfg)
    row["planned_allocated_gib"] = plan.device_peak_bytes / api.GIB
    row.update(modelled_margins(events, api.GIB) if cuda else {"modelled_margin_gib": None,
                                                                "modelled_held_margin_gib": None})
    if cuda and case.trace_allocator:  # the plan's requests, to set beside the run's (allocator_margin --compare)
        allocator_model().save_requests(requests_log(workdir, case, "plan"), events)
    if case.held_to_fit_margin:
        row["held_to_gib"] = fit_margin_limit(api, plan) / api.GIB
        if cuda:
            memory_fraction = row["held_to_gib"] * api.GIB / torch.cuda.get_device_properties(0).total_memory
            row["memory_fraction"] = memory_fraction
    row["planned_host_gib"] = plan.host_peak_bytes / api.GIB
    row["plan_predicts"] = plan.predicts
    cfg.output_dir = str(workdir / case.name)
    if cuda:
        if memory_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(memory_fraction)
        torch.cuda.empty_cache()
        if case.trace_allocator:
            row["allocated_before_trace_gib"] = torch.cuda.memory_allocated() / api.GIB  # not in the history
            torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                                     max_entries=TRACE_MAX_ENTRIES)
    run = api.setup_run(cfg)
    memory = api.MemoryConfig.from_config(cfg)
    source = api.resolve_model_source(cfg.model)
    setup_start = time.perf_counter()
    model, activation_context = api.setup_model(source, device=run.device, dtype=run.dtype, lora=cfg.get("lora"),
                                                memory=memory, placement=run.placement)
    optimizer = api.build_optimizer(cfg.optimizer, model, memory, placement=run.placement)
    loss_fn = api.build_loss(cfg.get("loss"))
    row["setup_s"] = time.perf_counter() - setup_start
    if case.fla:  # setup probed the kernel: a case that asks for it and would run the PyTorch form says why instead
        from mtune.modules.gated_deltanet_fla import recurrence_runs

        runs = recurrence_runs(run.device)
        if not runs.startswith("flash-linear-attention's"):
            return {**row, "status": "failed", "linear_attention": runs, "reason": f"the recurrence runs {runs}"}
    # plan_check's tracker over the first steps, exactly as TrainingSession sets it up (off under compile)
    tracking = bool(cfg.get("plan_check")) and not cfg.get("compile")
    breakdown = api.MemoryBreakdown(model, api.inner_optimizers(optimizer), run.output_dir, enabled=tracking,
                                    write=False, placement=run.placement, track_all_steps=False)
    recomputes = isinstance(loss_fn, api.ChunkedCrossEntropyLoss) and loss_fn.recomputes_projection(model.lm_head)
    generator = torch.Generator().manual_seed(0)
    batch = synthetic_batch(int(cfg.batch_size), int(cfg.tokenizer.max_seq_len), source.args.vocab_size, generator,
                            case.document_tokens, case.row_bound)
    # FLOPs as a run counts this batch (StepFlops): each packed document's attention against itself under the
    # segment kernels, the whole row under the dense mask
    step_flops = api.StepFlops(model, loss_recomputes_projection=recomputes, memory=memory)
    fpt, row["attention_len"] = batch_flops(step_flops, batch)
    if cuda:
        batch = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = allocator_counts(cuda)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step():
        with contextlib.ExitStack() as stack:
            stack.enter_context(breakdown.track_step())
            if activation_context is not None:
                stack.enter_context(activation_context)
            return api.train_step(model, [batch], loss_fn, optimizer, device=run.device, autocast=run.autocast,
                                  clip_grad_norm=cfg.get("clip_grad_norm"))

    times, losses = [], []
    for i in range(case.warmup + case.steps):
        sync()
        start = time.perf_counter()
        result = step()
        sync()
        times.append(time.perf_counter() - start)
        losses.append(result.loss)
    # how often the allocator, short of room, waited for every stream and returned its free segments (a stall each)
    row.update({k: (v - before[k] if before[k] is not None else None) for k, v in allocator_counts(cuda).items()})
    if "allocated_before_trace_gib" in row:  # the allocator's history is being recorded
        row.update(traced_allocator(api, memory_fraction, requests_log(workdir, case, "run")))
    timed = times[case.warmup:]
    step_s = statistics.median(timed)
    tokens = int(cfg.batch_size) * int(cfg.tokenizer.max_seq_len)
    row.update(first_step_s=times[0], step_times_s=times, step_s=step_s, tokens_per_step=tokens,
               tokens_per_s=tokens / step_s, losses=losses, tracked_steps=breakdown.tracked_steps)
    peak = api.peak_flops(run.device, run.dtype_name)
    row["peak_flops"] = peak.flops if peak else None
    row["peak_flops_source"] = peak.source if peak else None
    row["model_flops_per_token"], row["hardware_flops_per_token"] = fpt.model, fpt.hardware
    row["attention_flops_per_token"] = fpt.parts.get("attention", 0.0)
    row["mfu"] = fpt.model * row["tokens_per_s"] / peak.flops if peak else None
    row["hfu"] = fpt.hardware * row["tokens_per_s"] / peak.flops if peak else None
    row["measured_tensor_gib"] = breakdown.overall.peak["device"] / api.GIB if breakdown.overall else None
    if cuda:
        row["max_allocated_gib"] = torch.cuda.max_memory_allocated() / api.GIB
        row["max_reserved_gib"] = torch.cuda.max_memory_reserved() / api.GIB
        free, total = torch.cuda.mem_get_info()
        row["device_used_gib"] = (total - free) / api.GIB  # the whole card: context and managed (paged) memory too
        row["plan_error"] = row["planned_allocated_gib"] / row["max_allocated_gib"] - 1
    else:
        row.update(max_allocated_gib=None, max_reserved_gib=None, device_used_gib=None, plan_error=None)
    if row["measured_tensor_gib"]:
        row["plan_vs_tracker_error"] = row["planned_allocated_gib"] / row["measured_tensor_gib"] - 1
    # one more step under the profiler, only to name the attention kernel (not timed)
    from torch.profiler import ProfilerActivity, profile

    from torch._C._profiler import _ExperimentalConfig

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    # verbose on CUDA: the Python stacks some torch builds record only with it (pytorch#100253); the GPU's profiles
    # held no Python frame at all (profile_site_events, the seventh lease: Python 3.12 there, 3.11 on the CPU, whose
    # profiles have them without it, and where it costs a dry run's step more than a second)
    verbose = _ExperimentalConfig(verbose=True) if cuda else None
    with profile(activities=activities, with_stack=True, experimental_config=verbose) as prof:
        step()
        sync()
    row["attention_kernel"] = attention_kernel({e.name for e in prof.events()})
    row.update(profile_top(prof, cuda))
    if not case.torchao_dequantize and not nf4_dequantize.COMPILED_ON_CUDA:  # the kernel failed: the run's log says why
        row["nf4_dequantize"] = "torchao eager (the compiled kernel could not be built)"
    row["dynamo_limits_hit"] = dynamo_limits_hit()
    if any(type(m).__name__ == "GatedDeltaNet" for m in model.modules()):
        from mtune.modules.gated_deltanet_fla import recurrence_runs

        row["linear_attention"] = recurrence_runs(run.device)
    try:  # one more step: what autograd holds for backward outside the checkpointed blocks (not timed)
        groups: dict = {}
        row["saved_for_backward_gib"] = api.saved_for_backward_bytes(step, model, groups) / api.GIB
        largest = sorted(groups.items(), key=lambda item: -item[1][1])[:SAVED_GROUPS_KEPT]
        row["saved_for_backward_largest"] = [f"{count} x {key}: {nbytes / api.GIB:.3f} GiB"
                                             for key, (count, nbytes) in largest]
    except Exception as err:  # a diagnostic: its failure is said in the row, not the case's
        row["saved_for_backward_error"] = f"{type(err).__name__}: {err}"[-300:]
    del model, optimizer, batch
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        if memory_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(1.0)
    return row


# ------------------------------------------------------------------------------------------------ the kinds
def measure(api, case: Case, *, device: str, dry_run: bool, workdir: Path, args) -> dict:
    """One case's row (without the environment fields)."""
    import torch

    row = {"case": case.name, "part": case.part, "kind": case.kind, "what": case.what, "compile": case.compile,
           "dry_run": dry_run, "status": "ok"}
    if case.kind == "head_to_head":
        return {**row, **head_to_head(api, case, device=device, dry_run=dry_run, workdir=workdir, args=args)}
    if case.kind == "oom_recovery":
        return {**row, **oom_recovery(api, case, device=device, dry_run=dry_run, workdir=workdir)}
    if case.kind == "preference":
        return {**row, **preference_run(api, case, device=device, dry_run=dry_run, workdir=workdir)}
    cfg, missing = case_config(api, case, device=device, dry_run=dry_run)
    if missing:
        return {**row, "status": "pending", "reason": f"waits for {case.pending}: the {case.recipe} recipe has no "
                f"key {', '.join(missing)} yet"}
    fraction = None
    if case.kind == "fit":
        budget = (DRY_RUN["device_memory_gib"] if dry_run else case.device_memory_gib) * api.GIB
        fitted = workdir / f"{case.name}.yaml"
        overrides = [o for o in case_config_overrides(case, device, dry_run)]
        rc = api.cli_main(["plan", "--fit", "--device-memory", f"{budget / api.GIB}GiB", "--output", str(fitted),
                           case.recipe, "--config", case.config, *overrides])
        if rc or not fitted.exists():
            return {**row, "status": "failed", "reason": f"mtune plan --fit found no config for {budget / api.GIB:.2f} GiB"}
        cfg = fitted_config(api, case, fitted)
        row["fit_config"] = fitted.read_text()
        row["device_memory_gib"] = budget / api.GIB
        if torch.cuda.is_available() and device == "cuda":
            fraction = min(1.0, budget / torch.cuda.get_device_properties(0).total_memory)
        row["memory_fraction"] = fraction
    if case.kind == "longest_context":
        lengths = DRY_RUN["context_lengths"] if dry_run else args.context_lengths
        budget = (DRY_RUN["device_memory_gib"] * api.GIB if dry_run or not torch.cuda.is_available()
                  else torch.cuda.get_device_properties(0).total_memory - api.CUDA_CONTEXT_BYTES)
        fits = []
        for length in sorted(lengths):
            planned, _ = case_config(api, case, device=device, dry_run=dry_run, seq_len=length)
            plan = api.plan_memory(planned)
            fits.append({"seq_len": length, "planned_gib": plan.device_peak_bytes / api.GIB})
            if plan.device_peak_bytes > budget:
                break
        row["context_plans"] = fits
        longest = [f["seq_len"] for f in fits if f["planned_gib"] * api.GIB <= budget]
        if not longest:
            return {**row, "status": "failed", "reason": f"no length of {sorted(lengths)} is planned to fit"}
        cfg, _ = case_config(api, case, device=device, dry_run=dry_run, seq_len=longest[-1])
    if dry_run:
        case = replace(case, steps=DRY_RUN["steps"], warmup=DRY_RUN["warmup"])
    row.update(batch_size=int(cfg.batch_size), seq_len=int(cfg.tokenizer.max_seq_len))
    measured: dict = {}
    try:
        return {**row, **run_case(api, case, cfg, workdir=workdir, memory_fraction=fraction, row=measured)}
    except torch.OutOfMemoryError as err:
        if not case.held_to_fit_margin:
            raise
        # refused within --fit's margin: what the allocator held when it gave up is the finding
        figures = {"max_allocated_gib": torch.cuda.max_memory_allocated() / api.GIB,
                   "max_reserved_gib": torch.cuda.max_memory_reserved() / api.GIB, **allocator_counts(True)}
        if "allocated_before_trace_gib" in measured:  # recorded: did the model refuse the same request?
            figures.update(traced_allocator(api, measured.get("memory_fraction"), requests_log(workdir, case, "run")))
        return {**row, **measured, **figures, "status": "out_of_memory", "reason": str(err)[-1500:]}


OOM_LIMIT_SHARE = 0.75
"""``oom_recovery`` holds a run to this share of its own plan's device peak (the fit issue's done-when)."""


def _run_shape(case: Case, dry_run: bool) -> SimpleNamespace:
    """An ``mtune run`` case's ``warmup`` and timed ``steps`` added (``steps``), ``warmup``, ``batch`` and ``seq``
    (the dry run's :data:`DRY_RUN` sizes)."""
    if dry_run:
        return SimpleNamespace(steps=DRY_RUN["warmup"] + DRY_RUN["steps"], warmup=DRY_RUN["warmup"],
                               batch=DRY_RUN["batch_size"], seq=DRY_RUN["seq_len"])
    return SimpleNamespace(steps=case.warmup + case.steps, warmup=case.warmup, batch=case.batch_size,
                           seq=case.seq_len)


def _mtune_run(api, case: Case, *, device: str, dry_run: bool, workdir: Path, data_overrides: list[str],
               limit_share: float | None = None) -> SimpleNamespace:
    """``mtune run`` of the case's config in a process of its own, as a user runs it: random weights by family and
    size (the dry run: the tests' tiny Llama 3.1 checkpoint, whose vocabulary fits the tokenizer), the tests' tiny
    Llama 3 tokenizer, the dataset ``data_overrides`` name, ``warmup + steps`` steps with a line each; with
    ``limit_share``, under ``device_memory_limit`` at that share of what the config's plan says it needs (of the
    card's memory, where that is less). Returns the process (``done``), its metrics rows, the plan's device peak
    (``planned``, bytes), the limit, and the run's :func:`_run_shape` (``shape``)."""
    import torch

    sys.path.insert(0, str(REPO))
    from tests._helpers.recipes import read_metrics, write_tiny_checkpoint
    from tests._helpers.tokenizers import write_tokenizer_files

    tokenizer, out = workdir / f"{case.name}_tokenizer", workdir / case.name
    overrides = [o for o in case_config_overrides(case, device, dry_run)
                 if not o.startswith(("tokenizer.path=", "model."))]
    if dry_run:
        tokenizer = write_tiny_checkpoint(workdir / f"{case.name}_checkpoint")
        overrides.append(f"model.checkpoint_dir={tokenizer}")
    else:
        write_tokenizer_files(tokenizer, "llama3")
        overrides += [o for o in case.overrides if o.startswith("model.")]
    shape = _run_shape(case, dry_run)
    overrides += [f"tokenizer.path={tokenizer}", *data_overrides, f"max_steps_per_epoch={shape.steps}",
                  f"output_dir={out}", "overwrite_output_dir=true", "log_every_n_steps=1",
                  f"compile={str(case.compile).lower()}"]
    module = api.load_recipe_module(api.find_recipe(case.recipe))
    planned = api.plan_memory(api.load_and_check(module, api.find_config(case.config), overrides)).device_peak_bytes
    limit = None
    if limit_share is not None:
        # a share of the plan, or of the card where the plan is larger: a limit over the card binds nothing (the
        # H100's 79 GiB bound the 2026-11-26 row, its limit 83.6 GiB)
        card = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else planned
        limit = int(limit_share * min(planned, card))
        overrides.append(f"device_memory_limit={limit}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-m", "mtune", "run", case.recipe, "--config", case.config, *overrides],
                          capture_output=True, text=True, env=env)
    (workdir / f"{case.name}.run.log").write_text(done.stdout + done.stderr)
    return SimpleNamespace(done=done, rows=read_metrics(out) if (out / "metrics.jsonl").exists() else [],
                           planned=planned, limit=limit, shape=shape, out=out)


def _failure(run: SimpleNamespace) -> dict:
    """The row's status: failed with the run's last ``error:`` line (or its output's end) where it did not finish
    its steps; empty where it did."""
    if not run.done.returncode and len(run.rows) >= run.shape.steps:
        return {}
    error = next((line for line in run.done.stderr.splitlines()[::-1] if line.startswith("error:")), None)
    return {"status": "failed", "reason": error or (run.done.stdout + run.done.stderr)[-1500:]}


def oom_recovery(api, case: Case, *, device: str, dry_run: bool, workdir: Path) -> dict:
    """:func:`_mtune_run` on packed rows of a synthetic instruction set, held at :data:`OOM_LIMIT_SHARE` of its
    plan: the re-plan lines, every step's trained tokens (the same when recovery keeps the samples per step), the
    allocator's peak per logged step against the limit, and how the run ended."""
    sys.path.insert(0, str(REPO))
    from tests._helpers.recipes import write_instruct_data

    shape = _run_shape(case, dry_run)
    data = write_instruct_data(workdir / f"{case.name}.jsonl",  # rows of 10-20 tokens
                               n=shape.batch * shape.seq * shape.steps // 8 + 64)
    run = _mtune_run(api, case, device=device, dry_run=dry_run, workdir=workdir, limit_share=OOM_LIMIT_SHARE,
                     data_overrides=["dataset._component_=mtune.data.instruct_dataset", f"dataset.source={data}",
                                     "dataset.cache=false"])
    peaks = [r["peak_memory_gib"] for r in run.rows if r.get("peak_memory_gib") is not None]
    return {"batch_size": shape.batch, "seq_len": shape.seq, "planned_allocated_gib": run.planned / api.GIB,
            "device_memory_limit_gib": run.limit / api.GIB, "exit_status": run.done.returncode,
            "replans": [line.split("mtune: ", 1)[-1] for line in run.done.stderr.splitlines()
                        if "oom_recovery:" in line],
            "steps_done": [r["step"] for r in run.rows], "trained_tokens": [r.get("trained_tokens") for r in run.rows],
            "losses": [r.get("loss") for r in run.rows],
            "max_allocated_gib": max(peaks) if peaks and device == "cuda" else None,
            "fit_config": (run.out / "mtune_fit.yaml").read_text() if (run.out / "mtune_fit.yaml").exists() else None,
            **_failure(run)}


def preference_run(api, case: Case, *, device: str, dry_run: bool, workdir: Path) -> dict:
    """:func:`_mtune_run` of a preference (DPO) case on the tiny task's pairs (mtune's asset) packed whole into rows
    of 2 x ``seq_len`` tokens, so every row is full as the plan assumes: tokens/s (the median of the steps after
    ``warmup``, as mtune logs them: plan_check's tracked steps excluded) and the allocator's peak over the logged
    steps (a precomputed reference's pass before them is not among them) against the plan of the same config."""
    from mtune.assets import tiny_data_dir

    # its 1,024 pairs pack into 50 rows of 2 x 1,024 tokens with the tests' tokenizer, three times an 8B case's 8
    # steps of 2 rows; reference=precomputed runs the reference over all of them first
    data = tiny_data_dir() / "preference_train.jsonl"
    run = _mtune_run(api, case, device=device, dry_run=dry_run, workdir=workdir,
                     data_overrides=[f"dataset.source={data}", "dataset.split=train", "dataset.packed=true",
                                     "dataset_val=null"])
    timed = [r["tokens_per_second"] for r in run.rows[run.shape.warmup:] if r.get("tokens_per_second")]
    peaks = [r["peak_memory_gib"] for r in run.rows if r.get("peak_memory_gib") is not None]
    measured = max(peaks) if peaks and device == "cuda" else None
    return {"batch_size": run.shape.batch, "seq_len": run.shape.seq, "planned_allocated_gib": run.planned / api.GIB,
            "tokens_per_s": statistics.median(timed) if timed else None, "max_allocated_gib": measured,
            "plan_error": run.planned / api.GIB / measured - 1 if measured else None,
            "losses": [r.get("loss") for r in run.rows], "rewards_accuracy": [r.get("rewards/accuracies")
                                                                              for r in run.rows],
            "exit_status": run.done.returncode, **_failure(run)}


def case_config_overrides(case: Case, device: str, dry_run: bool) -> list[str]:
    """The overrides `mtune plan --fit` gets: the case's own, with the dry run's model and shape."""
    overrides = list(case.overrides)
    if dry_run:
        overrides = [o for o in overrides if not o.startswith(("model.family=", "model.size="))]
        overrides += [f"model.family={DRY_RUN['family']}", f"model.size={DRY_RUN['size']}"]
    seq = DRY_RUN["seq_len"] if dry_run else case.seq_len
    batch = DRY_RUN["batch_size"] if dry_run else case.batch_size
    return overrides + [f"device={device}", "dtype=bf16", f"batch_size={batch}", f"tokenizer.max_seq_len={seq}",
                        "dataset.packed=true", "tokenizer.path=null"]


def head_to_head(api, case: Case, *, device: str, dry_run: bool, workdir: Path, args) -> dict:
    """``benchmarks/torchtune_head_to_head.py`` for one LoRA case: both libraries, the case's shape, interleaved."""
    out = workdir / f"{case.name}_h2h"
    shape = _run_shape(case, dry_run)
    seq, batch = (DRY_RUN["head_to_head_seq"] if dry_run else shape.seq), shape.batch
    torchtune = torchtune_python(args)
    libs = ["mtune"] + (["torchtune"] if torchtune else [])
    command = [sys.executable, str(REPO / "benchmarks" / "torchtune_head_to_head.py"), "--device", device,
               "--cases", "lora", "--dtypes", "bf16", "--compile", "on" if case.compile else "off", "--reps", "1",
               "--steps", str(shape.steps), "--warmup", str(shape.warmup),
               "--batch", str(batch), "--seq", str(seq), "--out", str(out), "--work", str(workdir / "h2h_fixture"),
               "--libs", *libs, "--no-ceiling", "--profile"] + (["--parity"] if torchtune else [])
    if not dry_run:
        command += ["--shape", "llama3_2_3B"]
    if torchtune:
        command += ["--torchtune-python", torchtune[0]] + (["--torchtune-path", torchtune[1]] if torchtune[1] else [])
    proc = subprocess.run(command, capture_output=True, text=True, cwd=str(REPO))
    (workdir / f"{case.name}_h2h.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        return {"status": "failed", "reason": (proc.stdout + proc.stderr)[-1500:]}
    result = json.loads((out / "torchtune_head_to_head.json").read_text())
    summary, runs = result["summary"][0], result["runs"]
    mine = summary.get("mtune", {})
    theirs = summary.get("torchtune", {})
    run_of = {r["lib"]: r for r in runs if "error" not in r}
    cuda = device == "cuda"
    row = {"batch_size": batch, "seq_len": seq, "shape": "fixture (tiny)" if dry_run else "llama3_2_3B",
           "tokens_per_s": mine.get("tokens_per_second"), "mfu": mine.get("mfu"), "hfu": mine.get("hfu"),
           "max_allocated_gib": run_of.get("mtune", {}).get("cuda_max_allocated_gib") if cuda else None,
           "max_reserved_gib": run_of.get("mtune", {}).get("cuda_max_reserved_gib") if cuda else None,
           "torchtune_tokens_per_s": theirs.get("tokens_per_second"),
           "torchtune_max_allocated_gib": run_of.get("torchtune", {}).get("cuda_max_allocated_gib") if cuda else None,
           "losses": run_of.get("mtune", {}).get("losses"), "torchtune_losses": run_of.get("torchtune", {}).get("losses"),
           "speedup": summary.get("speedup"), "peak_flops": result["meta"]["peak_flops"].get("bf16"),
           # both libraries' first LoRA step on rows both see whole (the harness's --parity): the same work
           "first_step_parity": (result.get("parity") or [None])[0],
           # each library's last step profiled alike (--profile): where the two steps' time differs
           **{f"{prefix}{key}": run_of.get(lib, {}).get(key)
              for lib, prefix in (("mtune", ""), ("torchtune", "torchtune_"))
              for key in ("profile_top_cpu", "profile_top_device")},
           "attention_kernel": None, "planned_allocated_gib": None}
    if torchtune:
        row["torchtune"] = torchtune[2]
    else:
        row["torchtune_skipped"] = ("torchtune 0.6.1 is not installed for this run: pass --torchtune-python or "
                                    "--torchtune-path (docs/benchmarks.md, 'GPU suite')")
    errors = {lib: summary[lib]["error"] for lib in ("mtune", "torchtune") if "error" in summary.get(lib, {})}
    if errors:
        row.update(status="failed", reason=json.dumps(errors)[-1500:])
    config = sorted(Path(out).parent.glob("h2h_fixture/**/runs/mtune_lora_*.yaml"))  # --shape adds a level
    if config:  # plan the mtune run the harness made (its own fixture checkpoint: only config.json is read)
        cfg, _ = case_config(api, replace(case, overrides=()), device=device, dry_run=False, seq_len=seq,
                             config_path=str(config[-1]))
        row["planned_allocated_gib"] = api.plan_memory(cfg).device_peak_bytes / api.GIB
    return row


def torchtune_python(args) -> tuple[str, str | None, str] | None:
    """``(python, extra PYTHONPATH, torchtune's version)`` of a python that imports torchtune, or None."""
    python = args.torchtune_python or sys.executable
    path = args.torchtune_path
    env = {**os.environ, "PYTHONPATH": path} if path else {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = subprocess.run([python, "-c", "import torchtune, torchao; print(torchtune.__version__)"], env=env,
                           capture_output=True, text=True)
    return (python, path, probe.stdout.strip()) if probe.returncode == 0 else None


# ------------------------------------------------------------------------------------------------ output
COLUMNS = [("case", "{}"), ("compile", "{}"), ("gpu_name", "{}"), ("tokens_per_s", "{:,.0f}"), ("mfu", "{:.1%}"),
           ("hfu", "{:.1%}"), ("planned_allocated_gib", "{:.2f}"), ("max_allocated_gib", "{:.2f}"),
           ("plan_error", "{:+.1%}"), ("max_reserved_gib", "{:.2f}"), ("attention_kernel", "{}"),
           ("torchtune_tokens_per_s", "{:,.0f}"), ("torchtune_max_allocated_gib", "{:.2f}"), ("status", "{}")]


def table(rows: list[dict]) -> str:
    def cell(row, key, fmt):
        value = row.get(key)
        return "–" if value is None else fmt.format(value)

    head = "| " + " | ".join(k for k, _ in COLUMNS) + " |"
    rule = "|" + "|".join("---" if f == "{}" else "---:" for _, f in COLUMNS) + "|"
    return "\n".join([head, rule] + ["| " + " | ".join(cell(r, k, f) for k, f in COLUMNS) + " |" for r in rows])


def write_results(rows: list[dict], out: Path) -> None:
    """Append ``rows`` to ``out`` (JSON: {"rows": [...]}) and rewrite the markdown table beside it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    existing = json.loads(out.read_text())["rows"] if out.exists() else []
    everything = existing + rows
    out.write_text(json.dumps({"rows": everything}, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text(
        "<!-- written by benchmarks/gpu_suite.py from " + out.name + " -->\n" + table(everything) + "\n")


# ------------------------------------------------------------------------------------------------ main
def run_cases(cases: list[Case], *, dry_run: bool, out: Path, args, in_process: bool) -> list[dict]:
    """Measure ``cases`` (each in its own process unless ``in_process``), within the part's time budget."""
    env = environment(mtune_api())
    device = "cuda" if env["gpu_name"] and not dry_run else "cpu"
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    start = time.perf_counter()
    rows = []
    workdir = Path(args.work or tempfile.mkdtemp(prefix="mtune_gpu_suite_"))
    workdir.mkdir(parents=True, exist_ok=True)
    for case in cases:
        spent = time.perf_counter() - start
        if case.fla and not dry_run and not args.fla_path:
            row = {"case": case.name, "part": case.part, "status": "skipped",
                   "reason": "flash-linear-attention not carried: pass --fla-path (scripts/gpu_wheels.sh's .whl/fla)"}
        elif not dry_run and spent + case.minutes * 60 > args.budget_s:
            row = {"case": case.name, "part": case.part, "status": "skipped",
                   "reason": f"the part's budget: {spent:.0f} s spent, ~{case.minutes * 60:.0f} s needed, "
                             f"{args.budget_s:.0f} s allowed"}
        elif in_process:
            try:
                row = measure(mtune_api(), case, device=device, dry_run=dry_run, workdir=workdir, args=args)
            except Exception as err:  # one case's failure is a row, not the end of the part
                if args.raise_errors:
                    raise
                row = {"case": case.name, "part": case.part, "status": "failed",
                       "reason": f"{type(err).__name__}: {err}"[-1500:]}
        else:
            row = run_in_subprocess(case, dry_run=dry_run, workdir=workdir, args=args)
        row = {**row, **{k: v for k, v in env.items() if k not in row}, "date": date,
               "wall_s": time.perf_counter() - start - spent}
        rows.append(row)
        print(f"{case.name}: {row['status']}" + (f" ({row.get('reason', '')[:300]})" if row["status"] != "ok" else
              f", {row.get('tokens_per_s') or 0:,.0f} tok/s, mfu {row.get('mfu') or 0:.1%}, "
              f"planned {row.get('planned_allocated_gib') or 0:.2f} GiB, allocated {row.get('max_allocated_gib')}")
              + f" [{row['wall_s']:.0f} s]", flush=True)
        write_results([row], out)  # after each case: a lease that ends mid-part keeps the rows it measured
    print(table(rows))
    return rows


def run_in_subprocess(case: Case, *, dry_run: bool, workdir: Path, args) -> dict:
    """One case in a fresh process (a fresh CUDA context and allocator: no case inherits another's cache)."""
    result = workdir / f"{case.name}.row.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--one-case", case.name, str(result),
               "--work", str(workdir)] + (["--dry-run"] if dry_run else [])
    for flag in ("torchtune_python", "torchtune_path"):
        if getattr(args, flag):
            command += ["--" + flag.replace("_", "-"), getattr(args, flag)]
    command += ["--context-lengths", *map(str, args.context_lengths)]
    env = {**os.environ, **dict(case.env)}
    if case.fla:  # the kernels importable for this case only: its twin without them runs the PyTorch form
        env["PYTHONPATH"] = os.pathsep.join(p for p in (args.fla_path, env.get("PYTHONPATH")) if p)
    log = workdir / f"{case.name}.log"
    with log.open("w") as sink:  # written as the case runs: a case killed by the lease's timeout keeps its log
        proc = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, text=True, env=env)
    if result.exists():
        return json.loads(result.read_text())
    return {"case": case.name, "part": case.part, "status": "failed",
            "reason": f"exit {proc.returncode}: " + log.read_text()[-1500:]}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", type=int, help="run this part's cases (--list shows them)")
    parser.add_argument("--cases", nargs="+", help="only these cases (of --part, or of every part)")
    parser.add_argument("--dry-run", action="store_true", help="on a CPU: tiny shapes, a few steps, every part")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"JSON the rows are appended to (default {DEFAULT_OUT.relative_to(REPO)}; a dry run "
                             "must name one)")
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    parser.add_argument("--in-process", action="store_true", help="every case in this process (tests)")
    parser.add_argument("--no-compile", action="store_true", help="run compiled cases eagerly (dry-run tests)")
    parser.add_argument("--budget-s", type=float, default=PART_BUDGET_S, help="stop starting cases after this")
    parser.add_argument("--work", default=None, help="scratch directory (default: a new temporary one)")
    parser.add_argument("--torchtune-python", default=None, help="a python that imports torchtune 0.6.1")
    parser.add_argument("--torchtune-path", default=None,
                        help="PYTHONPATH for torchtune's runs (e.g. /tmp/site_tt:/tmp/site on the GPU machine)")
    parser.add_argument("--fla-path", default=None,
                        help="PYTHONPATH holding flash-linear-attention (fla-core) for the cases that use its kernels")
    parser.add_argument("--context-lengths", nargs="+", type=int, default=[8192, 16384, 32768, 65536, 131072])
    parser.add_argument("--raise-errors", action="store_true", help="let a failing case raise (debugging)")
    parser.add_argument("--one-case", nargs=2, metavar=("CASE", "RESULT"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.list:
        for case in CASES:
            state = f"pending: {case.pending}" if case.pending else f"~{case.minutes:g} min"
            print(f"part {case.part}  {case.name:<44} {case.kind:<16} {state}\n        {case.what}")
        return []
    if args.one_case:
        name, result = args.one_case
        case = select(None, [name])[0]
        case = replace(case, compile=False) if args.no_compile else case
        env = environment(mtune_api())
        device = "cuda" if env["gpu_name"] and not args.dry_run else "cpu"
        if device == "cuda":  # where a case spends its time (kernel compilation, autotuning) if the lease ends it
            import faulthandler

            faulthandler.dump_traceback_later(STACK_DUMP_S, repeat=True)
        try:
            row = measure(mtune_api(), case, device=device, dry_run=args.dry_run, workdir=Path(args.work), args=args)
        except Exception as err:
            import traceback

            traceback.print_exc()
            row = {"case": case.name, "part": case.part, "status": "failed",
                   "reason": f"{type(err).__name__}: {err}"[-1500:]}
        # this process's environment, not the suite's: a case's own env (part 17's allocator settings) shows here
        row = {**row, **{k: v for k, v in env.items() if k not in row}}
        Path(result).write_text(json.dumps(row, default=str))
        return [row]
    if args.dry_run and args.out is None:
        raise SystemExit("--dry-run writes only where --out says (never into benchmarks/results)")
    if not args.dry_run and args.part is None and not args.cases:
        raise SystemExit("name a --part (or --cases); --list shows them")
    cases = select(None if args.dry_run and args.part is None else args.part, args.cases)
    if args.no_compile:
        cases = [replace(c, compile=False) for c in cases]
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU here: run with --dry-run --out FILE on a CPU")
    return run_cases(cases, dry_run=args.dry_run, out=args.out or DEFAULT_OUT, args=args, in_process=args.in_process)


if __name__ == "__main__":
    main()

"""What a memory technique tells the planner, and the priorities it declares in: its `Footprint` for a model of
given `ModelFacts` (the work it makes backward repeat, `Recompute`, included), its ``--fit`` dimension (`FitKnob`)
and options (`FitChoice`, ranked by `QUALITY_TIERS` where lossy) and its out-of-memory advice (:func:`advice`, in
the named `ADVICE_TIERS`). Pure Python, no torch (`mtune.training.memory.technique` re-exports every name)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RUN_KINDS", "ADVICE_TIERS", "QUALITY_TIERS", "advice", "FitKnob", "FitChoice", "ModelFacts", "Footprint",
           "Recompute", "BlockOffload"]

RUN_KINDS = ("single_device", "distributed")
"""What `MemoryConfig.kind` says: the recipe runs on one device, or sharded with FSDP2."""

ADVICE_TIERS = (
    "dense_mask",             # a packed row's s² mask: the largest activation at long context
    "activation_checkpointing",
    "mlp_tiles",
    "activation_offloading",
    "micro_batch",            # the run's: a smaller batch_size with more accumulation
    "lora",                   # train adapters instead of every weight
    "qlora",
    "low_bit_states",
    "optimizer_in_bwd",
    "optimizer_offload",
    "fsdp_cpu_offload",
    "weight_offloading",
    "chunked_loss",
    "dtype",                  # the run's: bf16 weights
    "seq_len",                # the run's: shorter rows
)
"""Out-of-memory advice, most effective first: each piece of advice names its tier; within a tier, registry order.
The run's own advice (batch, dtype, sequence length) has tiers here too (`mtune.training.memory.oom`)."""

QUALITY_TIERS = {"clipping_dropped": 1, "low_bit_states": 2, "fp8_base": 3, "nf4_base": 5}
"""What a lossy ``--fit`` choice gives up, and its rank: ``--fit`` tries the smallest sum of ranks over a candidate's
choices first (NF4 outranks fp8 with clipping dropped; the measured drifts: docs/plan.md)."""


def advice(tier: str, text: str) -> tuple[int, str]:
    """One piece of out-of-memory advice in ``tier`` (a name of `ADVICE_TIERS`), sortable with the others."""
    return ADVICE_TIERS.index(tier), text


@dataclass(frozen=True)
class FitKnob:
    """A technique's dimension of the ``mtune plan --fit`` search: its ``name`` (in the answer's levels) and
    whether all its choices save is in the floor ``--fit`` computes before planning (weights, states, gradients),
    none in activations (``floor_only``): such a choice whose floor saving is negligible for the budget is not
    searched. ``offloads``: its higher levels save the device by moving bytes to the host, so a lower level leaves
    the host room for more of what is offloaded as far as the host holds it (blocks' inputs): ``--fit`` prunes by
    such a candidate's failure only the candidates at its level of this knob."""

    name: str
    floor_only: bool = False
    offloads: bool = False


class FitChoice:
    """One option of a technique in the ``--fit`` search: ``level`` (higher saves more memory; 0 leaves the technique
    off), ``overrides`` (config keys -> values; a mapping value replaces that node whole, so no key of the component
    it replaces survives), and, when the option changes what a step computes compared with the user's config,
    ``lossy`` (what is given up, in a few words). ``quality`` names its tier in `QUALITY_TIERS`, what it gives up
    against full precision (ranked even where the user's config gives it up already, so ``lossy`` is None)."""

    __slots__ = ("level", "overrides", "lossy", "quality")

    def __init__(self, level: int, overrides: dict, lossy: str | None = None, quality: str | None = None):
        if (lossy or quality is not None) and quality not in QUALITY_TIERS:
            raise ValueError(f"a lossy FitChoice names its quality tier, one of {list(QUALITY_TIERS)}: got {quality!r}")
        self.level, self.overrides, self.lossy, self.quality = level, overrides, lossy, quality

    @property
    def quality_cost(self) -> int:
        """The rank of its tier (0: none)."""
        return QUALITY_TIERS.get(self.quality, 0)

    def __iter__(self):  # unpacks as (level, overrides)
        return iter((self.level, self.overrides))

    def __repr__(self) -> str:
        return f"FitChoice({self.level}, {self.overrides}" + (f", lossy={self.lossy!r})" if self.lossy else ")")


@dataclass(frozen=True)
class ModelFacts:
    """What the cost model knows of a candidate: the model's shape and stored bytes, and the tokens of a
    micro-batch and of an optimizer step."""

    n_layers: int
    dim: int
    trainable_bytes: float
    """Trainable parameters as stored (fp32 under ``dtype=fp16``: its weights are fp32)."""
    frozen_bytes: float
    """Frozen parameters as stored (NF4 about 0.516 byte a weight with its scales, fp8 one byte)."""
    residual_bytes: int
    """Bytes per element of the residual stream between blocks (what offloaded block inputs hold): the storage
    dtype's, since under fp16 autocast the stream stays fp32."""
    micro_batch_tokens: int
    step_tokens: int
    cuda: bool = False
    """Whether the run computes on a CUDA device (paged optimizer states exist only there)."""
    trainable_numel: int = 0
    """Trainable parameter elements (optimizer states and the host optimizer step scale with them)."""
    world_size: int = 1
    """Ranks the model is sharded over (FSDP2); the bytes above are the whole model's."""
    frozen_block_bytes: float | None = None
    """Of ``frozen_bytes``, those stored inside the blocks (the rest: the embedding, the output projection, the final
    norm); None: all of them."""

    @property
    def frozen_in_blocks(self) -> float:
        return self.frozen_bytes if self.frozen_block_bytes is None else self.frozen_block_bytes

    @property
    def micro_batches(self) -> int:
        return max(1, self.step_tokens // max(1, self.micro_batch_tokens))


@dataclass(frozen=True)
class Recompute:
    """Forward work a technique makes backward do again, per block, as the FLOPs counter reads it: each block's
    checkpointing policy (``block``, ``selective_op`` or None) and whether its MLP runs over tiles."""

    checkpoint: tuple[str | None, ...] | None = None
    mlp_tiled: tuple[bool, ...] | None = None


@dataclass(frozen=True)
class BlockOffload:
    """What a technique that moves the tensors the model's blocks save to the host does: the first ``blocks`` of
    ``n_layers`` blocks offload, the rest keep theirs on the device; ``key`` is the config key that sets the count
    (0: none of the blocks; None: every block). The host's share is a line in the count (each block saves the same
    bytes), so the planner estimates a count between 0 and all from those two plans, and ``--fit`` offloads as many
    blocks as the host holds where it cannot hold them all."""

    blocks: int
    n_layers: int
    key: str


@dataclass(frozen=True)
class Footprint:
    """What one technique, as configured, does to a run's memory and time: the one value the planner reads (the
    cost model folds every technique's; at most one technique names each home, the rules see to it)."""

    frozen_weights_home: str | None = None
    """``"host"`` when the frozen weights wait in host memory between uses; ``"host_blocks"`` when only the blocks'
    do (`ModelFacts.frozen_in_blocks`), the embedding and output projection staying on the device; None: the
    technique says nothing."""
    trainable_weights_home: str | None = None
    """``"host"`` when the trainable weights live in host memory (the device holds them only while a block runs)."""
    states_home: str | None = None
    """Where the optimizer states live: ``"host"`` (stepped there), ``"managed"`` (CUDA managed memory, paged by the
    driver, outside the caching allocator), or None."""
    state_bytes_per_element: float | None = None
    """Optimizer-state bytes per trainable element, where this technique decides them."""
    frees_gradients: bool = False
    """Whether the full set of gradients never exists on the device (stepped or moved as backward makes them)."""
    transfer_bytes_per_token: float = 0.0
    """Bytes moved between the device and the host per trained token (of one rank)."""
    host_step_elements: int = 0
    """Trainable elements whose optimizer step runs on the host CPU each step."""
    repeat_blocks: int = 1
    """The fewest consecutive blocks over which its per-block memory repeats (every Nth block checkpointed: N);
    ``--fit`` plans shortened models of multiples of it and extrapolates per layer."""
    lossy: str | None = None
    """What it gives up in the numbers a step computes, in a few words (None: the same step up to round-off)."""
    shapes_parameters: bool = False
    """Whether its model phase decides which parameters exist, which train and how they are stored (adapters, NF4,
    fp8): the cost model's meta model applies the model phase of these techniques only."""
    not_planned: str | None = None
    """Why ``mtune plan`` plans the run without this technique (it cannot model it), as the plan's note; None: it
    is planned."""
    compiles: bool = False
    """Whether its model phase compiles modules (``nn.Module.compile``): a plan compiles them alike, with AOT
    autograd's partitioner and no code generation, and counts what the compiled code runs."""
    frozen_bytes_per_weight: float | None = None
    """Bytes a frozen 2-D weight inside the blocks takes once stored (NF4: about 0.516 with its scales); None: its
    dtype's. The embedding and the output projection keep their dtype unless a technique's module stores them."""
    recompute: Recompute = Recompute()
    """The forward work backward repeats for the facts' blocks (``n_layers``, ``dim``, ``micro_batch_tokens``): what
    the FLOPs counter reads."""
    block_offload: BlockOffload | None = None
    """Which of the facts' blocks save to the host, where the technique moves what blocks save; None: it does
    not."""

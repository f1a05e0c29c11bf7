"""Weight group offloading (``weight_offloading``): frozen weights wait in host memory and visit the compute device
one group at a time.

The groups are ``blocks_per_group`` consecutive transformer blocks (``block_level``; the embedding, final norm and
output projection stay on the device), or every module that holds weights on its own, embedding and output
projection included (``leaf_level``: least memory, most transfers). Only frozen parameters move: the base of
LoRA / DoRA / QLoRA (NF4 tensors move as their packed parts), or the whole model in ``generate``; trainable ones
(adapters) stay on the device, and the validator refuses weight offloading for a full fine-tune.

How a weight comes and goes. Each offloaded parameter keeps its tensor on the compute device, but the storage
behind it is emptied (``untyped_storage().resize_(0)``) while its group is away; a host copy (pinned on CUDA) holds
the values. Bringing a group in re-grows the storages and copies the host bytes back through a separate alias of
each storage, so the parameter's version counter (checked by autograd) never moves. Because the parameter and every
view of it that autograd saved for backward share that one storage, emptying it really frees the memory, and
re-filling it restores what backward reads.

When groups move. A group is brought in by a forward pre-hook on each module holding its weights (this also covers
activation checkpointing's recomputation, which calls those modules again) and by a pre-hook on each autograd node
that those modules created (so backward brings in a group just before its gradient is computed, whatever the
autograd engine unpacks first). Bringing in a group sends every other group away, except, with ``use_streams``,
the next one in the direction of travel (forward: the next group; backward and recomputation: the previous one),
which is prefetched. So at most one group (two with ``use_streams``) is on the device at any moment. On CUDA the
prefetch copies run on a side stream from pinned memory and the compute stream waits for them with an event;
elsewhere they run in line (no overlap: set ``use_streams: false`` there). Both hooks only fetch weights
(``FETCHES_WEIGHT``): the chunked loss runs an offloaded head's pre-hook alone and needs its weight in forward only.

Recomputation under ``leaf_level``: a checkpointed block is recomputed when the first node of its backward unpacks
a saved tensor; that node belongs to the block's last module in forward, the last one the recomputation brings in,
so it is on the device when the node continues (``block_level`` recomputes the very group backward needs; a block
whose backward started elsewhere would read an emptied storage). ``selective_op`` checkpointing needs the copies
out of its count of ops (`dispatch_modes`). Without an accelerator nothing is installed (a log line says so);
``Placement("cpu", distinct=True)`` makes every copy real on CPU (tests); the validator refuses torch.compile.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from mtune.config.errors import ConfigError
from mtune.modules.loss import FETCHES_WEIGHT
from mtune.training.memory.technique import WeightPhases
from mtune.training.memory.techniques.weight_offloading import WeightOffloading
from mtune.training.memory.techniques.weight_offloading.dispatch_modes import outside_selective_checkpointing
from mtune.training.memory.tensor_bytes import plain_parts
from mtune.training.placement import Placement, storage_key

__all__ = ["WeightOffloader", "OffloadedWeights", "apply_weight_offloading", "weight_offloader",
           "offloaded_weights_materialized"]

log = logging.getLogger(__name__)

_ATTRIBUTE = "_mtune_weight_offloader"


def _frozen_parameters(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters(recurse=False) if not p.requires_grad]


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1  # inside backward (which includes checkpoint recomputation)


@dataclass
class _Slot:
    """One offloaded storage: a byte alias of the compute-device storage and the host copy of its bytes."""

    alias: torch.Tensor
    host: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.host.numel()


class WeightOffloader:
    """Moves the frozen weights of ``model`` between host memory and the compute device, group by group (see the
    module docstring). Built by :func:`apply_weight_offloading`; weights move to the host as they are loaded
    (:meth:`offload_module`) or all at once (:meth:`offload`).

    Attributes:
        groups: per group, the modules holding its weights, in forward order.
        copies_to_compute: bytes copied host -> compute device so far (logs and tests).
    """

    def __init__(self, model: nn.Module, config: WeightOffloading, placement: Placement):
        self.config, self.placement, self.prefetch = config, placement, config.use_streams
        self.stream = torch.cuda.Stream() if config.use_streams and placement.streams else None
        self.groups = self._partition(model, config)
        self._group_of: dict[nn.Module, int] = {m: g for g, mods in enumerate(self.groups) for m in mods}
        self._slots: list[list[_Slot]] = [[] for _ in self.groups]
        self._slot_keys: dict[int, int] = {}  # storage_key -> group, for every storage already offloaded
        self._resident: set[int] = set()  # groups whose storages are filled
        self._ready: dict[int, torch.cuda.Event] = {}  # prefetched groups: their copy's event
        self.copies_to_compute = 0
        for module, g in self._group_of.items():
            module.register_forward_pre_hook(self._make_pre_forward(g))
            module.register_forward_hook(self._make_post_forward(g))

    @staticmethod
    def _partition(model: nn.Module, config: WeightOffloading) -> list[list[nn.Module]]:
        if config.type == "block_level":
            blocks = list(model.layers)
            groups = []
            for start in range(0, len(blocks), config.blocks_per_group):
                modules = [m for block in blocks[start:start + config.blocks_per_group] for m in block.modules()
                           if _frozen_parameters(m)]
                if modules:
                    groups.append(modules)
            return groups
        if config.type == "leaf_level":
            groups: list[list[nn.Module]] = []
            owner: dict[int, int] = {}  # id(parameter) -> its group: a tied lm_head joins the embedding's group
            for module in model.modules():
                params = _frozen_parameters(module)
                if not params:
                    continue
                shared = next((owner[id(p)] for p in params if id(p) in owner), None)
                if shared is None:
                    groups.append([module])
                    shared = len(groups) - 1
                else:
                    groups[shared].append(module)
                owner.update((id(p), shared) for p in params)
            return groups
        raise ConfigError(f"weight_offloading.type={config.type!r}: use block_level or leaf_level")

    # ---------------------------------------------------------------------------------------- to the host
    @torch.no_grad()
    def offload_module(self, module: nn.Module) -> None:
        """Move ``module``'s loaded frozen weights (those not moved yet) to host memory and free their device
        storage. Called for each module as the checkpoint streams in, so the model never sits whole on the device."""
        g = self._group_of.get(module)
        if g is None:
            return
        for param in _frozen_parameters(module):
            for t in plain_parts(param):
                key = storage_key(t)
                if t.is_meta or key in self._slot_keys:
                    continue
                storage = t.untyped_storage()
                alias = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
                slot = _Slot(alias, self.placement.to_host(alias))
                storage.resize_(0)
                self._slots[g].append(slot)
                self._slot_keys[key] = g
        if g in self._resident:  # no longer whole: all sent away (unmarked only, the rest would stay filled)
            self._evict(g)

    def offload(self) -> None:
        """Move every frozen weight not moved yet to host memory (after random initialisation, or after loading)."""
        for modules in self.groups:
            for module in modules:
                self.offload_module(module)
        self._evict_all()
        moved = sum(slot.nbytes for slots in self._slots for slot in slots)
        log.info("weight_offloading: %.1f MiB of frozen weights in %d groups (%s) wait in %s memory",
                 moved / 2**20, len(self.groups), self.config.type, self.placement.host)

    # ---------------------------------------------------------------------------------- to the device
    def ensure(self, g: int, backward: bool) -> None:
        """Make group ``g`` resident for compute; send the others away, except the one to prefetch next."""
        following = g - 1 if backward else g + 1
        keep = {g}
        if self.prefetch and 0 <= following < len(self.groups):
            keep.add(following)
        for other in sorted(self._resident - keep):
            self._evict(other)
        if g in self._resident:
            event = self._ready.pop(g, None)
            if event is not None:
                torch.cuda.current_stream().wait_event(event)
        else:
            self._copy_in(g, prefetch=False)
        if len(keep) == 2 and following not in self._resident:
            self._copy_in(following, prefetch=True)

    @torch.no_grad()
    def _copy_in(self, g: int, prefetch: bool) -> None:
        """Re-grow group ``g``'s storages and copy its bytes in from the host (prefetches: on CUDA's side stream)."""
        side = self.stream if prefetch else None  # prefetches come from the side stream's pool (in line: marked so)
        with self.placement.side_stream(side) if prefetch else contextlib.nullcontext(), \
                outside_selective_checkpointing():
            for slot in self._slots[g]:
                slot.alias.untyped_storage().resize_(slot.nbytes)
                slot.alias.copy_(slot.host, non_blocking=self.placement.pinned)
                if side is not None:
                    slot.alias.record_stream(torch.cuda.current_stream(self.placement.compute))
                self.copies_to_compute += slot.nbytes
        if side is not None:
            self._ready[g] = side.record_event()
        self._resident.add(g)

    def _evict(self, g: int) -> None:
        for slot in self._slots[g]:
            slot.alias.untyped_storage().resize_(0)
        self._ready.pop(g, None)
        self._resident.discard(g)

    def _evict_all(self) -> None:
        for g in sorted(self._resident):
            self._evict(g)

    @contextlib.contextmanager
    def materialized(self) -> Iterator[None]:
        """Every group on the device inside the block (e.g. DoRA magnitudes from the loaded base, a merged save of
        a model without a base checkpoint); all sent away after it."""
        for g in range(len(self.groups)):
            if g not in self._resident:
                self._copy_in(g, prefetch=False)
        try:
            yield
        finally:
            self._evict_all()

    def resident_groups(self) -> set[int]:
        return set(self._resident)

    # ------------------------------------------------------------------------------------------- hooks
    def _make_pre_forward(self, g: int):
        # Recomputation (inside backward) runs forward again: block_level recomputes the group backward is about to
        # use, so the next one to prefetch is the one before it; leaf_level walks the block's leaves forward.
        def pre_forward(module, args):
            self.ensure(g, backward=_in_backward() and self.config.type == "block_level")

        setattr(pre_forward, FETCHES_WEIGHT, True)
        return pre_forward

    def _make_post_forward(self, g: int):
        def prehook(grad_outputs):
            self.ensure(g, backward=True)

        def post_forward(module, args, output):
            if not torch.is_grad_enabled() or _in_backward():
                return  # no backward to prepare (recomputation's nodes are never run themselves)
            # Every autograd node this module's forward created runs with the group resident: a pre-hook on each,
            # found by walking back from the outputs to the inputs' nodes.
            inputs = {a.grad_fn for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor) and a.grad_fn}
            stack = [o.grad_fn for o in tree_flatten(output)[0] if isinstance(o, torch.Tensor) and o.grad_fn]
            seen = set()
            while stack:
                node = stack.pop()
                if node is None or node in seen or node in inputs or type(node).__name__ == "AccumulateGrad":
                    continue
                seen.add(node)
                node.register_prehook(prehook)
                stack.extend(next_node for next_node, _ in node.next_functions)

        setattr(post_forward, FETCHES_WEIGHT, True)
        return post_forward


def apply_weight_offloading(model: nn.Module, config: WeightOffloading, placement: Placement | None = None
                            ) -> WeightOffloader | None:
    """Install weight offloading on ``model`` (after LoRA / NF4, which decide what is frozen; a meta-device model
    is fine: the weights move when they are loaded). Returns the offloader (also found by
    :func:`weight_offloader`), or None when the compute device is the host and nothing would move."""
    placement = placement or Placement.default()
    if not placement.distinct:
        log.info("weight_offloading: the model computes in host memory (%s): nothing to offload", placement.compute)
        return None
    offloader = WeightOffloader(model, config, placement)
    setattr(model, _ATTRIBUTE, offloader)
    return offloader


def weight_offloader(model: nn.Module) -> WeightOffloader | None:
    """The `WeightOffloader` installed on ``model``, or None."""
    return getattr(model, _ATTRIBUTE, None)


def offloaded_weights_materialized(model: nn.Module):
    """A context with every offloaded weight of ``model`` on the compute device (a no-op context without
    offloading): for code that reads weights outside forward, such as a merged-model save."""
    offloader = weight_offloader(model)
    return offloader.materialized() if offloader is not None else contextlib.nullcontext()


class OffloadedWeights(WeightPhases):
    """Weight offloading's weight phases: frozen weights leave the device as soon as they arrive, what loading did
    not move (random initialisation) once all are in, and every one comes back for a save."""

    def arrived(self, model: nn.Module, module: nn.Module) -> None:
        offloader = weight_offloader(model)
        if offloader is not None:
            offloader.offload_module(module)

    def all_arrived(self, model: nn.Module, sharded: bool, materialized) -> None:
        offloader = weight_offloader(model)
        if offloader is not None:
            offloader.offload()

    def full_form(self, model: nn.Module):
        return offloaded_weights_materialized(model)

"""weight_offloading's schedule and its weights' lifecycle, read off the weights themselves: which group is copied to
the compute device when (demand or prefetch), which groups are resident as each module starts (the prefetch runs in
the direction of travel), and where every frozen weight is after loading, ``offload()`` and ``materialized()``.

These hold what the bit-identical comparisons in ``test_weight_offloading`` cannot see: a prefetch in the wrong
direction, a group copied twice or left on the device costs time and memory but changes no result. The oracle is the
design in the offloader's docstring (at most one group, two with ``use_streams``: the one computing and the next one
in the direction of travel), the plain model's outputs, and each storage's own byte count (0 while away). On this
CPU-only machine ``Placement("cpu", distinct=True)`` makes every move a real copy."""

import contextlib
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mtune.models import build_model
from mtune.training.memory.registry import MemoryConfig
from mtune.training.memory.techniques.weight_offloading import WeightOffloading
from mtune.training.memory.techniques.weight_offloading.offloader import (OffloadedWeights, _in_backward,
                                                                          apply_weight_offloading, weight_offloader)
from mtune.training.memory.tensor_bytes import plain_parts
from mtune.training.placement import Placement
from tests._helpers.offloading import TOKENS, offloaded_loss_and_grads, offloaded_pair
from tests._helpers.training import assert_identical


def _frozen_device_bytes(modules) -> int:
    return sum(t.untyped_storage().nbytes() for m in modules for p in m.parameters(recurse=False)
               if not p.requires_grad for t in plain_parts(p))


def _record(offloader):
    """Log every copy to the device as ``(group, prefetch, in backward)``, and as each offloaded module starts (its
    own hook runs after the offloader's) ``(group, in backward, resident groups)``."""
    copies, starts = [], []
    original = offloader._copy_in

    def copy_in(g, prefetch):
        copies.append((g, prefetch, _in_backward()))
        original(g, prefetch)

    offloader._copy_in = copy_in
    for g, modules in enumerate(offloader.groups):
        for module in modules:
            module.register_forward_pre_hook(
                lambda m, args, g=g: starts.append((g, _in_backward(), offloader.resident_groups())))
    return copies, starts


def test_block_level_fetches_each_group_once_a_pass_and_prefetches_the_next_one_in_the_direction_of_travel():
    """3 blocks, one a group, ``use_streams``, checkpointed (backward recomputes each block). Forward demands group
    0 and prefetches 1 and 2 as each previous one starts; backward (recomputation and gradients) prefetches 1 and 0
    (2 is still there from forward); group 0 stays for the next step. Mutations seen failing: the prefetch direction
    swapped, group 0 never prefetched (``0 < following``), the prefetched group evicted and copied again, a resident
    group copied again, recomputation prefetching forward, the node pre-hooks prefetching forward, no prefetch."""
    memory = MemoryConfig(enable_activation_checkpointing=True, weight_offloading=WeightOffloading("block_level", 1,
                                                                                                     True))
    plain, twin, offloader, _ = offloaded_pair(memory, n_layers=3)
    copies, starts = _record(offloader)
    assert_identical(offloaded_loss_and_grads(plain), offloaded_loss_and_grads(twin))
    assert copies == [(0, False, False), (1, True, False), (2, True, False), (1, True, True), (0, True, True)]
    assert offloader.resident_groups() == {0}
    forward = {g: resident for g, backward, resident in starts if not backward}
    assert forward == {0: {0, 1}, 1: {1, 2}, 2: {2}}
    recomputed = {(g, frozenset(resident)) for g, backward, resident in starts if backward}
    assert recomputed == {(2, frozenset({2, 1})), (1, frozenset({1, 0})), (0, frozenset({0}))}


def test_leaf_level_recomputation_walks_the_block_forward_with_the_next_leaf_prefetched():
    """leaf_level recomputes a block leaf by leaf in forward order, so the leaf prefetched as each one starts is the
    next one, in forward and in recomputation alike. Mutation seen failing: recomputation prefetching the previous
    leaf (``backward=_in_backward()`` for leaf_level too: every leaf of the recomputation then copied on demand)."""
    memory = MemoryConfig(enable_activation_checkpointing=True, weight_offloading=WeightOffloading("leaf_level", 1,
                                                                                                    True))
    plain, twin, offloader, _ = offloaded_pair(memory, n_layers=2)
    copies, starts = _record(offloader)
    assert_identical(offloaded_loss_and_grads(plain), offloaded_loss_and_grads(twin))
    last = len(offloader.groups) - 1
    assert {backward for _, backward, _ in starts} == {False, True}
    for g, backward, resident in starts:
        assert resident == {g, min(g + 1, last)}, (g, backward, resident)
    # recomputation copies one leaf a block on demand (its first), the others arrive as prefetches; backward may
    # demand one more a block (the engine runs a block's nodes in its own order, not quite the leaves')
    on_demand = [g for g, prefetch, backward in copies if backward and not prefetch]
    blocks = [min(offloader._group_of[m] for m in block.modules() if m in offloader._group_of) for block in twin.layers]
    assert set(blocks) <= set(on_demand) and len(on_demand) <= 2 * len(blocks), (blocks, on_demand)


class _CopySides(TorchDispatchMode):
    """Every byte copy (the offloader's, uint8) with whether the placement marked it as a side stream's allocation."""

    def __init__(self, placement):
        super().__init__()
        self.placement, self.sides = placement, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default and args[0].dtype == torch.uint8:
            self.sides.append(self.placement.allocating_on_side_stream)
        return func(*args, **(kwargs or {}))


def test_a_prefetch_allocates_as_on_the_side_stream_and_a_demand_copy_does_not():
    """The planner's log of device storages reads ``allocating_on_side_stream`` (CUDA keeps a side stream's freed
    blocks for that stream): on CPU a prefetch runs in line but is marked so, a demand copy is not. Mutation seen
    failing: the prefetch run outside ``placement.side_stream``."""
    torch.manual_seed(0)
    model = build_model("llama3_1", "tiny", device="cpu", n_layers=2).requires_grad_(False)
    placement = Placement("cpu", distinct=True)
    offloader = apply_weight_offloading(model, WeightOffloading("block_level", 1, True), placement)
    offloader.offload()
    per_group = [len(slots) for slots in offloader._slots]
    with torch.no_grad(), _CopySides(placement) as mode:
        model(TOKENS[:1, :4])
    assert mode.sides == [False] * per_group[0] + [True] * per_group[1]  # group 0 on demand, 1 prefetched


def test_a_block_without_frozen_weights_forms_no_group():
    """A block whose every weight is trained has nothing to offload: no (empty) group of its own, so the prefetch
    from the block before it fetches the next block that has weights. Mutation seen failing: empty groups kept."""
    torch.manual_seed(0)
    model = build_model("llama3_1", "tiny", device="cpu", n_layers=3).requires_grad_(False)
    model.layers[1].requires_grad_(True)
    offloader = apply_weight_offloading(model, WeightOffloading("block_level", 1, True),
                                        Placement("cpu", distinct=True))
    offloader.offload()
    assert len(offloader.groups) == 2 and all(offloader.groups)
    assert model.layers[2].self_attn.q_proj in offloader.groups[1]
    starts = []
    model.layers[0].self_attn.q_proj.register_forward_pre_hook(
        lambda m, a: starts.append(offloader.resident_groups()))  # after the offloader's own
    with torch.no_grad():
        model(TOKENS[:1, :4])
    assert starts == [{0, 1}]  # block 2's group prefetched as block 0 starts


def test_a_weight_still_on_meta_moves_once_it_is_loaded():
    """The offloader is installed on a meta-device model; a module whose weights have not arrived yet is skipped,
    and moves when they have. Mutation seen failing: meta tensors not skipped (a host copy of a meta tensor)."""
    model = build_model("llama3_1", "tiny", n_layers=1).requires_grad_(False)
    offloader = apply_weight_offloading(model, WeightOffloading("block_level", 1, False),
                                        Placement("cpu", distinct=True))
    q_proj = model.layers[0].self_attn.q_proj
    offloader.offload_module(q_proj)
    assert offloader._slots == [[]]
    q_proj.to_empty(device="cpu")
    torch.nn.init.normal_(q_proj.weight)
    expected = q_proj.weight.clone()
    offloader.offload_module(q_proj)
    assert [slot.nbytes for slot in offloader._slots[0]] == [expected.numel() * 4]
    assert q_proj.weight.untyped_storage().nbytes() == 0
    with offloader.materialized():
        assert torch.equal(q_proj.weight, expected)


def test_a_weight_offloaded_while_its_group_is_resident_is_fetched_before_its_next_use():
    """One group holding the whole model's blocks is resident after a forward; a module of it whose weights had
    stayed (not moved yet) now moves: the whole group goes away (every one of its weights, not only the one that
    moved), and the next forward fetches it. Mutation seen failing: ``offload_module`` leaving the group marked
    resident (the next forward reads an emptied weight); before the fix the group's other weights stayed on the
    device, marked away."""
    torch.manual_seed(0)
    plain = build_model("llama3_1", "tiny", device="cpu", n_layers=2).requires_grad_(False)
    twin = copy.deepcopy(plain)
    offloader = apply_weight_offloading(twin, WeightOffloading("block_level", 2, False),
                                        Placement("cpu", distinct=True))
    late = twin.layers[1].mlp.down_proj
    for module in offloader.groups[0]:
        if module is not late:
            offloader.offload_module(module)
    with torch.no_grad():
        expected = plain(TOKENS[:1, :8])
        assert torch.equal(twin(TOKENS[:1, :8]), expected)
        assert offloader.resident_groups() == {0}
        offloader.offload_module(late)
        assert offloader.resident_groups() == set() and _frozen_device_bytes(twin.layers.modules()) == 0
        assert torch.equal(twin(TOKENS[:1, :8]), expected)


@pytest.fixture
def after_a_step():
    """A block_level twin after one training step (group 0 resident: the last one backward used)."""
    memory = MemoryConfig(weight_offloading=WeightOffloading("block_level", 1, False))
    plain, twin, offloader, _ = offloaded_pair(memory, n_layers=3)
    offloaded_loss_and_grads(twin)
    assert offloader.resident_groups() == {0} and _frozen_device_bytes(twin.layers[0].modules()) > 0
    return plain, twin, offloader


def test_materialized_copies_only_what_is_away_and_sends_every_group_away_after(after_a_step):
    """Inside ``materialized()`` every frozen weight is on the device with the plain model's values (only groups 1
    and 2 copied: 0 is there); after it, and after a block that raised, none is. Mutations seen failing: the groups
    not sent away after (or not when the block raises), a resident group copied again, ``_evict_all`` a no-op."""
    plain, twin, offloader = after_a_step
    before = offloader.copies_to_compute
    with offloader.materialized():
        assert offloader.resident_groups() == {0, 1, 2}
        assert offloader.copies_to_compute - before == sum(s.nbytes for g in (1, 2) for s in offloader._slots[g])
        frozen = {k: v for k, v in twin.state_dict().items() if "lora" not in k}
        assert all(torch.equal(v, plain.state_dict()[k]) for k, v in frozen.items())
    assert offloader.resident_groups() == set() and _frozen_device_bytes(twin.layers.modules()) == 0
    with pytest.raises(RuntimeError, match="inside"):
        with offloader.materialized():
            raise RuntimeError("inside")
    assert offloader.resident_groups() == set() and _frozen_device_bytes(twin.layers.modules()) == 0


def test_offload_sends_every_resident_group_away(after_a_step):
    """``offload()`` leaves every frozen weight on the host, whatever was resident. It failed before the fix:
    ``offload_module`` marked a resident group away without emptying its storages, so ``offload()`` after a step
    left group 0's weights on the device (2.4 MB here), uncounted, until the group came and went again. Mutations
    seen failing: ``offload()`` without its ``_evict_all``, ``_evict_all`` a no-op."""
    _, twin, offloader = after_a_step
    offloader.offload()
    assert offloader.resident_groups() == set() and _frozen_device_bytes(twin.layers.modules()) == 0


def test_weights_move_to_the_host_as_each_module_arrives():
    """``OffloadedWeights.arrived`` moves a module's frozen weights as soon as they are in (a model never sits whole
    on the device while it loads); ``all_arrived`` moves the rest; ``full_form`` brings them all back. Mutation seen
    failing: ``arrived`` doing nothing."""
    torch.manual_seed(0)
    model = build_model("llama3_1", "tiny", device="cpu", n_layers=2).requires_grad_(False)
    expected = copy.deepcopy(model.state_dict())
    apply_weight_offloading(model, WeightOffloading("block_level", 1, True), Placement("cpu", distinct=True))
    phases, first = OffloadedWeights(), model.layers[0].self_attn.q_proj
    phases.arrived(model, first)
    assert _frozen_device_bytes([first]) == 0
    assert _frozen_device_bytes([model.layers[0].self_attn.k_proj]) > 0
    phases.all_arrived(model, sharded=False, materialized=None)
    assert _frozen_device_bytes(model.layers.modules()) == 0
    with phases.full_form(model):
        assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    assert _frozen_device_bytes(model.layers.modules()) == 0 and weight_offloader(model).resident_groups() == set()


class _Plain(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("raises", [False, True])
def test_the_copies_run_with_the_modes_down_to_selective_checkpointings_set_aside_and_restored_in_order(raises):
    """``outside_selective_checkpointing`` with the stack [below, selective checkpointing's, above]: inside only
    ``below`` (the byte tracker's place) is left; after, even when the body raises, the same stack in the same order.
    Mutations seen failing: the modes pushed back in reverse, only the top mode set aside (``if`` for ``while``),
    the stack not restored when the body raises."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    from torch.utils.checkpoint import _CachingTorchDispatchMode

    from mtune.training.memory.techniques.weight_offloading.dispatch_modes import outside_selective_checkpointing

    below, selective, above = _Plain(), _CachingTorchDispatchMode(lambda *a, **k: None, {}), _Plain()
    with below, selective, above:
        with pytest.raises(RuntimeError) if raises else contextlib.nullcontext():
            with outside_selective_checkpointing():
                assert _get_current_dispatch_mode_stack() == [below]
                if raises:
                    raise RuntimeError("inside")
        assert _get_current_dispatch_mode_stack() == [below, selective, above]


def test_a_left_out_key_takes_its_documented_default():
    """``weight_offloading: {}`` is block_level, one block a group, with streams (the defaults the node declares and
    its help describes). Mutations seen failing: each of the three defaults changed, or a given key not read."""
    from omegaconf import OmegaConf

    node = MemoryConfig.from_config(OmegaConf.create({"output_dir": "x", "weight_offloading": {}})).weight_offloading
    assert node == WeightOffloading() == WeightOffloading("block_level", 1, True)
    given = {"type": "leaf_level", "blocks_per_group": 3, "use_streams": False}
    assert WeightOffloading.from_node(given) == WeightOffloading("leaf_level", 3, False)


@pytest.mark.parametrize("kind, blocks_per_group, use_streams, repeat", [
    ("block_level", 1, False, 1), ("block_level", 1, True, 2), ("block_level", 2, False, 2),
    ("block_level", 2, True, 4), ("leaf_level", 2, True, 1)])
def test_the_plan_repeats_the_blocks_the_offloader_keeps_on_the_device(kind, blocks_per_group, use_streams, repeat):
    """The footprint the planner charges: ``blocks_per_group`` blocks on the device, twice that with ``use_streams``
    (the bound ``test_exact_and_at_most_one_group_on_the_device`` measures on the offloader); a leaf_level group is
    one module inside a block. Mutations seen failing: the prefetch's group always counted, ``blocks_per_group``
    ignored."""
    from types import SimpleNamespace

    from mtune.training.memory.technique import ModelFacts
    from mtune.training.memory.techniques.activation_checkpointing import ACTIVATION_CHECKPOINTING
    from mtune.training.memory.techniques.weight_offloading import WEIGHT_OFFLOADING, WeightOffloadingSettings

    facts = ModelFacts(n_layers=4, dim=64, trainable_bytes=1e6, frozen_bytes=24e6, frozen_block_bytes=20e6,
                       residual_bytes=2, micro_batch_tokens=1000, step_tokens=4000)
    memory = {ACTIVATION_CHECKPOINTING: SimpleNamespace(enable_activation_checkpointing=False)}
    settings = WeightOffloadingSettings(weight_offloading=WeightOffloading(kind, blocks_per_group, use_streams))
    footprint = WEIGHT_OFFLOADING.footprint(settings, memory, facts)
    assert footprint.repeat_blocks == repeat
    assert footprint.frozen_weights_home == ("host_blocks" if kind == "block_level" else "host")


def test_out_of_memory_advice_names_weight_offloading_only_where_the_rules_accept_it():
    """The advice after an out-of-memory error never names a setting the validator would refuse: weight_offloading
    needs frozen weights (a lora node), one device and compile=false. Mutation seen failing: the advice given with
    compile=true."""
    from mtune.training.memory.oom import memory_advice

    cfg = {"batch_size": 1, "dtype": "bf16", "lora": {"modules": ["q_proj"], "rank": 4, "alpha": 8}}

    def advised(**changes):
        return any("weight_offloading" in line for line in memory_advice({**cfg, **changes}))

    assert advised()
    assert not advised(compile=True) and not advised(lora=None)
    assert not advised(weight_offloading={"type": "leaf_level"})  # already set

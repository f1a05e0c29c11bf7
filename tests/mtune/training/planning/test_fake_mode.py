"""The planner's dispatch (`mtune.training.planning.fake_mode`) against torch's own ``FakeTensorMode`` and the
run's `TensorTracker`: the cheaper dispatch-cache key tells arguments apart exactly where torch's key does, and a
plan made with `PlannerFakeMode` and `PlanningTracker` is the plan torch's mode and the tracker make, byte for byte.

Mutations seen failing: dropping the dtype, the sizes, the strides, the device, the storage offset, the storage
bytes, requires_grad, the conjugate, negative or inference bit from the key's tuple makes two of the arguments
below share a key that torch's key tells apart (``test_key_tells_apart_what_torchs_key_does``). The quantized bit
is kept but not tested (fake quantized tensors cannot be made here)."""

import dataclasses

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, _CacheKeyState

import mtune.training.planning.plan as plan_module
from mtune._cli.catalog import find_recipe, load_recipe_module
from mtune._cli.run import load_and_check
from mtune.training.planning.fake_mode import PlannerFakeMode, PlanningModes, PlanningTracker
from mtune.training.planning.tracker import TensorTracker
from tests._helpers.recipes import TRAIN_CONFIG, train_overrides, write_instruct_data, write_tiny_checkpoint


def _arguments() -> dict[str, tuple]:
    """Argument tuples of one op, each differing from another in one fact torch's key holds."""
    base = torch.empty(5, 6)
    complex_ = torch.empty(4, 6, dtype=torch.complex64)
    with torch.inference_mode():
        inference = torch.empty(4, 6)
    return {
        "plain": (torch.empty(4, 6), 2.0),
        "plain again": (torch.empty(4, 6), 2.0),  # the same facts: the same key
        "another scalar": (torch.empty(4, 6), 3.0),
        "int scalar": (torch.empty(4, 6), 2),  # 2 and 2.0 hash alike; their types tell them apart
        "dtype": (torch.empty(4, 6, dtype=torch.int32), 2.0),  # as wide as float32: the same storage bytes
        "shape": (torch.empty(4, 6)[:3], 2.0),  # the same strides and storage as "plain"
        "device": (torch.empty(4, 6, device="cuda"), 2.0),
        "strides": (torch.empty(6, 4).t(), 2.0),
        "offset 0 of a larger storage": (base[:4], 2.0),
        "offset 6": (base[1:], 2.0),  # differs from the line above in the storage offset only
        "requires_grad": (torch.empty(4, 6, requires_grad=True), 2.0),
        "complex": (complex_, 2.0),
        "conjugate": (complex_.conj(), 2.0),
        "negative": (torch._neg_view(complex_), 2.0),
        "inference": (inference, 2.0),
        "a list of two": ([torch.empty(4, 6), torch.empty(4, 6)], 2.0),
        "a list of one": ([torch.empty(4, 6)], 2.0),
    }


def _keys(mode: FakeTensorMode) -> dict[str, object]:
    with mode:
        arguments = _arguments()
    func = torch.ops.aten.mul.Scalar
    return {name: mode._cache_key(_CacheKeyState(mode.shape_env), func, args, {}) for name, args in
            arguments.items()}


def test_key_tells_apart_what_torchs_key_does():
    ours, torchs = _keys(PlannerFakeMode()), _keys(FakeTensorMode())
    assert ours["plain"] == ours["plain again"] and torchs["plain"] == torchs["plain again"]
    names = list(ours)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert (ours[a] == ours[b]) == (torchs[a] == torchs[b]), (a, b)


def test_a_plan_is_the_same_with_torchs_mode(tmp_path, monkeypatch):
    """QLoRA with checkpointing, offloading (block inputs of 2 MiB, over its 1 MiB floor), a tiled MLP and the
    chunked loss on the tiny model, two micro-batches,
    for a CUDA target (its host a place apart)."""
    checkpoint, data = write_tiny_checkpoint(tmp_path / "ckpt"), write_instruct_data(tmp_path / "train.jsonl")
    overrides = train_overrides(tmp_path, checkpoint, data, **{
        "tokenizer.max_seq_len": 64, "dataset.packed": True, "lora.quantize_base": True, "batch_size": 32,
        "gradient_accumulation_steps": 2, "enable_activation_checkpointing": True,
        "enable_activation_offloading": True, "mlp_tiles": 4,
        "loss._component_": "mtune.modules.loss.ChunkedCrossEntropyLoss", "device": "cuda"})
    cfg = load_and_check(load_recipe_module(find_recipe("lora_single_device")), TRAIN_CONFIG, overrides)

    def plan(mode_class, tracker_class):
        monkeypatch.setattr(plan_module, "planning_modes", lambda fake, compiled: PlanningModes(
            mode_class(allow_non_fake_inputs=True), tracker_class))
        return {k: v for k, v in dataclasses.asdict(plan_module.plan_memory(cfg)).items() if k != "seconds"}

    ours, torchs = plan(PlannerFakeMode, PlanningTracker), plan(FakeTensorMode, TensorTracker)
    assert ours == torchs
    assert ours["host_peak_bytes"] > 0  # the offloaded inputs count on the host: the host path was planned


def test_views_share_the_storage_they_view():
    """A cache hit on a view op gives a tensor on its input's storage (the byte tracker counts storages once)."""
    with PlannerFakeMode() as m:
        x = torch.empty(4, 6)
        views = [x.view(24), x.view(24)]  # the second is a cache hit
    assert m.cache_enabled
    assert all(v.untyped_storage()._cdata == x.untyped_storage()._cdata for v in views)


def test_a_torch_whose_cache_key_takes_other_arguments_plans_with_its_own_fake_mode(monkeypatch):
    """PlannerFakeMode overrides a private torch method; where its signature differs (torch 2.6's takes no
    id_hashed_objects), the planner uses torch's FakeTensorMode instead of failing at the first op. Mutation:
    always PlannerFakeMode fails the second assertion."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mtune.training.planning.fake_mode import PlannerFakeMode, planner_fake_mode

    assert type(planner_fake_mode()) is PlannerFakeMode  # this torch: the signature it was written against
    monkeypatch.setattr(FakeTensorMode, "_prep_args_for_hash", lambda self, result, args, state: None)
    assert type(planner_fake_mode()) is FakeTensorMode

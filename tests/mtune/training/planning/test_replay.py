"""Allocation replay (`mtune.training.planning.replay`): a replayed call leaves the byte tracker exactly where
running its ops would (the peak, what was live at it, every category's peak, the output's storage), and a plan made
with NF4 dequantization replayed is the plan made without it, byte for byte.

Mutations seen failing: not counting the replayed transient bytes (``hold`` of zeros) fails the first and third
tests and ten of the golden QLoRA plans (``tests/recipes/test_plan_shipped_flag_sets.py``); making the output before
its op's transient bytes are counted (the peak one op early) fails the first; replaying a call whose output is a view
into a larger storage fails the second."""

import contextlib
import dataclasses

import torch

import mtune.training.planning.plan as plan_module
from mtune._cli.catalog import find_recipe, load_recipe_module
from mtune._cli.run import load_and_check
from mtune.training.planning.fake_mode import PlanningTracker, planner_fake_mode
from mtune.training.planning.replay import AllocationReplay
from tests._helpers.recipes import TRAIN_CONFIG, train_overrides, write_instruct_data, write_tiny_checkpoint

MIB = 2 ** 20


def _shaped_call(x: torch.Tensor) -> torch.Tensor:
    """Allocates 4 MiB and 2 MiB of transients, frees the 4 MiB, then makes a 1 MiB output beside the 2 MiB: the
    call's peak is at the op before the output's."""
    big = x.new_empty(MIB)  # 4 MiB (float32)
    half = big.new_ones(MIB // 2)  # 2 MiB
    del big
    out = half.new_ones(MIB // 4)  # 1 MiB
    return out.view(-1, 1024)


def _run(calls: int, replay: bool):
    mode = planner_fake_mode()
    with mode:
        x = torch.empty(8)
    tracker = PlanningTracker(fake_mode=mode)
    replayer = AllocationReplay(tracker)
    outs = []
    with mode, tracker:
        for _ in range(calls):
            outs.append(replayer("call", lambda: _shaped_call(x), x.device) if replay else _shaped_call(x))
        during = tracker.current()
    return tracker.take_interval(), during, outs, replayer


def test_a_replayed_call_moves_the_tracker_as_its_ops_do():
    """Three calls, their outputs kept: the peak is in the third call, its 4 MiB and 2 MiB transients over the
    first two outputs (2 x 1 MiB): 8 MiB of activations, replayed or not (the input was made before tracking)."""
    ran, during_ran, outs_ran, _ = _run(3, replay=False)
    replayed, during_replayed, outs_replayed, replayer = _run(3, replay=True)
    assert replayer.replayed == 2
    assert ran.peak["device"] == 8 * MIB
    assert ran.as_dict() == replayed.as_dict()
    assert during_ran == during_replayed  # after the calls: only the three outputs live
    assert during_replayed["device"]["activations"] == 3 * MIB
    for a, b in zip(outs_ran, outs_replayed):
        assert (a.shape, a.stride(), a.dtype, a.untyped_storage().nbytes()) == \
               (b.shape, b.stride(), b.dtype, b.untyped_storage().nbytes())


def test_a_call_returning_a_view_into_a_larger_storage_is_not_replayed():
    mode = planner_fake_mode()
    with mode:
        x = torch.empty(8)
    tracker = PlanningTracker(fake_mode=mode)
    replayer = AllocationReplay(tracker)
    with mode, tracker:
        for _ in range(2):
            out = replayer("view", lambda: (x.new_empty(1024) * 2)[:16], x.device)
    assert replayer.traces["view"] is None and replayer.replayed == 0
    assert out.untyped_storage().nbytes() == 4096  # ran as it is: the view keeps its whole storage


def test_a_qlora_plan_is_the_same_with_dequantization_replayed(tmp_path, monkeypatch):
    """QLoRA with checkpointing, block-input offloading, block-level weight offloading and a tiled MLP on the tiny
    model, for a CUDA target (512-byte blocks, the host a place apart), with rows short enough (16 tokens) that the
    dequantized weights make the peak: every figure of the plan is the same."""
    checkpoint, data = write_tiny_checkpoint(tmp_path / "ckpt"), write_instruct_data(tmp_path / "train.jsonl")
    overrides = train_overrides(tmp_path, checkpoint, data, **{
        "tokenizer.max_seq_len": 16, "dataset.packed": True, "lora.quantize_base": True, "batch_size": 1,
        "gradient_accumulation_steps": 2, "enable_activation_checkpointing": True,
        "enable_activation_offloading": True, "mlp_tiles": 4, "device": "cuda",
        "weight_offloading": {"type": "block_level", "blocks_per_group": 1, "use_streams": True}})
    cfg = load_and_check(load_recipe_module(find_recipe("lora_single_device")), TRAIN_CONFIG, overrides)
    replayed_calls = []
    real = plan_module.replayed_nf4_dequantization

    @contextlib.contextmanager
    def counting(tracker, fused):  # torchao's eager dequantization, whatever the target (fused: the next test)
        with real(tracker) as replay:
            yield replay
        replayed_calls.append(replay.replayed)

    def plan(replay):
        monkeypatch.setattr(plan_module, "replayed_nf4_dequantization",
                            counting if replay else lambda tracker, fused: contextlib.nullcontext())
        return {k: v for k, v in dataclasses.asdict(plan_module.plan_memory(cfg)).items() if k != "seconds"}

    with_replay, without = plan(True), plan(False)
    assert sum(replayed_calls) > 0
    assert with_replay == without
    assert with_replay["host_peak_bytes"] > 0


def test_a_fused_dequantization_makes_its_scales_and_result_and_nothing_else():
    """For a CUDA target (:mod:`mtune.modules.nf4_dequantize`'s compiled kernel) dequantizing a fake NF4 weight of
    256 x 512 makes its bf16 block scales (2,048 values) and beside them its bf16 result, 256 KiB: the tracker's
    peak rises by those alone; torchao's eager ops, as a CPU target runs them, hold more on the way (int64 codes: at
    least 8 bytes a value more). Mutation seen failing: the fused flag not read (the eager ops' peak)."""
    from mtune.modules.nf4_linear import dequantize, quantize_nf4
    from mtune.training.planning.replay import fused_nf4_dequantization, replayed_nf4_dequantization

    assert fused_nf4_dequantization(torch.device("cuda"))
    assert not fused_nf4_dequantization(torch.device("cpu"))

    def peak(fused: bool) -> tuple[int, tuple]:
        mode = planner_fake_mode()
        with mode:
            weight = quantize_nf4(torch.empty(256, 512, dtype=torch.bfloat16))
        tracker = PlanningTracker(fake_mode=mode)
        with mode, tracker, replayed_nf4_dequantization(tracker, fused=fused):
            out = dequantize(weight)
            meta = (tuple(out.shape), out.dtype)
        return tracker.take_interval().peak["device"], meta

    fused, meta = peak(True)
    assert meta == ((256, 512), torch.bfloat16)
    assert fused == 256 * 512 * 2 + 256 * 512 // 64 * 2
    eager, _ = peak(False)
    assert eager >= fused + 256 * 512 * 8

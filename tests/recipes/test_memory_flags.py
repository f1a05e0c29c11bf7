"""Each memory technique against the plain run on the same seed and data, through the real recipes (in-process,
fp32 on CPU): activation checkpointing and offloading change nothing, optimizer-in-backward equals the plain
optimizer step, and gradient accumulation 2 x 2 equals batch 4."""

import pytest
import torch
from safetensors.torch import load_file

from tests._helpers.recipes import losses, run_recipe_in_process, train_overrides


def _run(tmp_path, tiny_checkpoint, tiny_data, name, recipe="lora_single_device", **changes):
    overrides = train_overrides(tmp_path / name, tiny_checkpoint, tiny_data, **changes)
    if recipe == "full_single_device":
        overrides.append("~lora")
    return run_recipe_in_process(recipe, overrides)


def _trained(out, recipe):
    if recipe == "lora_single_device":
        return load_file(out / "final" / "adapter" / "adapter_model.safetensors")
    return load_file(out / "final" / "model" / "model.safetensors")


@pytest.fixture(scope="module")
def plain(tmp_path_factory, tiny_checkpoint, tiny_data):
    tmp = tmp_path_factory.mktemp("plain")
    return {r: _run(tmp, tiny_checkpoint, tiny_data, r, recipe=r) for r in ("lora_single_device", "full_single_device")}


@pytest.mark.parametrize("recipe", ["lora_single_device", "full_single_device"])
def test_activation_checkpointing_and_offloading_are_bit_identical(tmp_path, tiny_checkpoint, tiny_data, plain, recipe):
    out = _run(tmp_path, tiny_checkpoint, tiny_data, "ac", recipe=recipe, enable_activation_checkpointing=True,
               enable_activation_offloading=True)
    assert losses(out) == losses(plain[recipe])
    expected, got = _trained(plain[recipe], recipe), _trained(out, recipe)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


def test_plain_runs_learn(plain):
    # 6 steps of lr 3e-3 on the word-reversal rows: LoRA (q, v, o; rank 8) and full fine-tuning both lower the loss.
    for recipe, drop in (("lora_single_device", 0.5), ("full_single_device", 2.0)):
        run = losses(plain[recipe])
        assert len(run) == 6 and run[-1] < run[0] - drop, (recipe, run)


@pytest.mark.parametrize("recipe", ["lora_single_device", "full_single_device"])
def test_optimizer_in_backward_equals_the_plain_step(tmp_path, tiny_checkpoint, tiny_data, plain, recipe):
    out = _run(tmp_path, tiny_checkpoint, tiny_data, "oib", recipe=recipe, optimizer_in_bwd=True)
    torch.testing.assert_close(torch.tensor(losses(out)), torch.tensor(losses(plain[recipe])), rtol=0, atol=1e-6)
    expected, got = _trained(plain[recipe], recipe), _trained(out, recipe)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=1e-6)


def test_gradient_accumulation_2x2_equals_batch_4(tmp_path, tiny_checkpoint, tiny_data, plain):
    out = _run(tmp_path, tiny_checkpoint, tiny_data, "accum", batch_size=2, gradient_accumulation_steps=2)
    # losses of ~6 in fp32 (an ulp is 4.8e-7): summed in another order they differ by a few ulps
    torch.testing.assert_close(torch.tensor(losses(out)), torch.tensor(losses(plain["lora_single_device"])),
                               rtol=1e-6, atol=0)
    expected, got = _trained(plain["lora_single_device"], "lora_single_device"), _trained(out, "lora_single_device")
    # Two micro-batches of 2 sum the gradient in a different order than one batch of 4; Adam's m / sqrt(v) turns
    # those last-bit differences into weight differences up to ~1e-6 after 6 steps (1.05e-6 measured with fused
    # AdamW). A dropped or double-counted micro-batch moves weights by the order of lr (3e-3) per step.
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=1e-5)


def test_val_loss_and_memory_breakdown(tmp_path, tiny_checkpoint, tiny_data, plain):
    import json

    from tests._helpers.recipes import read_metrics

    out = _run(tmp_path, tiny_checkpoint, tiny_data, "observed", eval_every_n_steps=3, memory_breakdown=True,
               **{"dataset_val._component_": "mtune.data.instruct_dataset", "dataset_val.source": str(tiny_data)})
    assert losses(out) == losses(plain["lora_single_device"])  # observing changes nothing
    val = [row for row in read_metrics(out) if "val_loss" in row]
    assert [row["step"] for row in val] == [3, 6] and val[1]["val_loss"] < val[0]["val_loss"]
    summary = json.loads((out / "memory_breakdown.json").read_text())
    peak = summary["device"]
    # LoRA on a 1.6M-parameter fp32 model: gradients and AdamW state exist only for the ~23K adapter parameters.
    assert peak["parameters"] > 4 * 1_500_000 and 0 < peak["gradients"] < peak["parameters"] / 20
    assert 1.9 * peak["gradients"] <= peak["optimizer_state"] <= 2.2 * peak["gradients"]
    assert peak["activations"] > 0 and summary["steps"][0]["activations"] > 0
    rows = [row for row in read_metrics(out) if "loss" in row]
    # the file covers the first 3 steps (written then); metrics.jsonl logs every step's own peak
    assert [row["peak_tensor_gib"] * 2**30 for row in rows[:3]] == [s["device_peak_bytes"] for s in summary["steps"]]
    assert all(row["peak_host_tensor_gib"] == 0 for row in rows)  # nothing offloaded
    assert (out / "memory_breakdown.png").read_bytes()[:4] == b"\x89PNG"

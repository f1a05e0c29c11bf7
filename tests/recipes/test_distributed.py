"""FSDP2 recipes on 2 CPU processes (gloo): the same losses and parameters as a single-device run with the same
global batch, exact resume on 2 ranks and resume on 1, and exports that transformers and peft load."""

import pytest
import torch
from safetensors.torch import load_file

from tests._helpers.recipes import losses, read_metrics, run_recipe_in_process, torchrun, train_overrides

pytestmark = pytest.mark.slow

SCHEDULE = ["max_steps_per_epoch=4", "save_every_n_steps=2",
            "lr_scheduler._component_=mtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
            "lr_scheduler.num_warmup_steps=1"]
VARIANTS = {
    "lora": ("lora_single_device", "lora_distributed", []),
    # with the chunked loss: it calls the (trained) output projection after the forward, outside FSDP2's hooks
    "full": ("full_single_device", "full_distributed", ["~lora",
                                                        "loss._component_=mtune.modules.loss.ChunkedCrossEntropyLoss"]),
    # with op-level selective checkpointing: FSDP2's gathers run outside the block's checkpoint
    "qlora": ("lora_single_device", "lora_distributed", ["lora.quantize_base=true", "lora.use_dora=true",
                                                         "enable_activation_checkpointing=true",
                                                         "activation_checkpointing_policy=selective_op"]),
}


def _trained(out, lora):
    return load_file(out / "final" / ("adapter/adapter_model.safetensors" if lora else "model/model.safetensors"))


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory, tiny_checkpoint, tiny_data):
    """Each variant once on 2 ranks (batch 2 each) and once on one device (batch 4): the same global batches."""
    runs = {}
    for name, (single, distributed, extra) in VARIANTS.items():
        tmp = tmp_path_factory.mktemp(name)
        torchrun(distributed, train_overrides(tmp / "dist", tiny_checkpoint, tiny_data, batch_size=2) + SCHEDULE + extra)
        reference = run_recipe_in_process(single, train_overrides(tmp / "single", tiny_checkpoint, tiny_data)
                                          + SCHEDULE + extra)
        runs[name] = (tmp / "dist" / "out", reference)
    return runs


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_two_ranks_match_one_device(two_rank_runs, variant):
    distributed, single = two_rank_runs[variant]
    # The global loss is summed over ranks in another order than over one batch: equal to float rounding.
    torch.testing.assert_close(torch.tensor(losses(distributed)), torch.tensor(losses(single)), rtol=0, atol=2e-5)
    lora = variant != "full"
    expected, got = _trained(single, lora), _trained(distributed, lora)
    assert expected.keys() == got.keys()
    for key in expected:
        # AdamW's first steps are ~lr * sign(g): gradients summed in another order move a weight by up to ~1% of lr.
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=3e-5)


def test_resume_on_two_ranks_is_exact_and_on_one_rank_continues(two_rank_runs, tmp_path, tiny_checkpoint, tiny_data):
    distributed, _ = two_rank_runs["lora"]
    expected = losses(distributed)
    overrides = train_overrides(tmp_path / "two", tiny_checkpoint, tiny_data, batch_size=2) + SCHEDULE
    torchrun("lora_distributed", overrides + [f"resume_from_checkpoint={distributed / 'step_2'}"])
    assert [r["step"] for r in read_metrics(tmp_path / "two" / "out")] == [3, 4]
    assert losses(tmp_path / "two" / "out") == expected[2:]  # bit for bit on the same number of ranks
    # On one process (a group of one) with the same global batch: the sharded state reshards to one rank.
    one = run_recipe_in_process("lora_distributed", train_overrides(tmp_path / "one", tiny_checkpoint, tiny_data)
                                + SCHEDULE + [f"resume_from_checkpoint={distributed / 'step_2'}"])
    torch.testing.assert_close(torch.tensor(losses(one)), torch.tensor(expected[2:]), rtol=0, atol=2e-5)


def test_gathered_exports_load_in_transformers_and_peft(two_rank_runs, tiny_checkpoint):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    distributed, _ = two_rank_runs["lora"]
    tokens = torch.arange(3, 40)[None]
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(distributed / "final" / "model").eval()(tokens).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()
        adapted = PeftModel.from_pretrained(base, distributed / "final" / "adapter").eval()(tokens).logits
        unadapted = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()(tokens).logits
    torch.testing.assert_close(merged, adapted, rtol=0, atol=1e-4)
    assert (merged - unadapted).abs().max() > 1e-2  # the adapter changed the model

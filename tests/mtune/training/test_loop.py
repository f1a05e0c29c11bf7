"""The training step: token-weighted loss over micro-batches, non-finite losses, and out-of-memory advice."""

import pytest
import torch
from torch import nn

from mtune.modules.loss import CrossEntropyLoss
from mtune.training.loop import NonFiniteLossError, build_loss, micro_batch_groups, train_step
from mtune.training.memory.oom import OutOfMemory, memory_advice, oom_guard


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.lm_head = nn.Linear(8, 16)

    def forward(self, tokens, input_pos=None, document_ids=None, return_hidden=False):
        return self.lm_head(self.embed(tokens))


def _batch(rows):
    tokens = torch.tensor([r[0] for r in rows])
    labels = torch.tensor([r[1] for r in rows])
    return {"tokens": tokens, "labels": labels}


def test_token_weighted_loss_over_micro_batches():
    # 3 trained tokens in the first micro-batch, 1 in the second: the step loss is the mean over all 4 tokens.
    a = _batch([([1, 2, 3], [2, 3, 4])])
    b = _batch([([5, 6, 7], [-100, -100, 8])])
    model = _Tiny()
    ce = nn.functional.cross_entropy
    with torch.no_grad():
        expected = (ce(model(a["tokens"])[0], a["labels"][0], reduction="sum")
                    + ce(model(b["tokens"])[0, 2:], b["labels"][0, 2:], reduction="sum")) / 4
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    result = train_step(model, [a, b], CrossEntropyLoss(), opt, device=torch.device("cpu"))
    assert result.trained_tokens == 4 and result.loss == pytest.approx(expected.item(), abs=1e-6)


@pytest.mark.parametrize("world_size", [1, 2])
def test_gradient_weights_every_trained_token_of_the_step_equally(world_size):
    """The step's gradient is that of the summed token loss over all micro-batches divided by the step's trained
    tokens (3 + 1 here), times ``world_size`` (FSDP averages over ranks; one rank here, all_reduce a no-op): SGD
    with lr=1 moves each weight by exactly that gradient, computed here with plain autograd.

    Mutation checked: each micro-batch's loss divided by its own trained tokens in ``step_on_tensors`` (a mean per
    micro-batch, which weighs the 1-token micro-batch like the 3-token one) fails; so does dropping the
    ``/ world_size`` from the denominator (the world_size=2 case)."""
    a = _batch([([1, 2, 3], [2, 3, 4])])
    b = _batch([([5, 6, 7], [-100, -100, 8])])
    reference = _Tiny()
    ce = nn.functional.cross_entropy
    summed = (ce(reference(a["tokens"])[0], a["labels"][0], reduction="sum")
              + ce(reference(b["tokens"])[0, 2:], b["labels"][0, 2:], reduction="sum"))
    (summed / 4 * world_size).backward()
    expected = {n: p.detach() - p.grad for n, p in reference.named_parameters()}
    model = _Tiny()
    train_step(model, [a, b], CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=1.0),
               device=torch.device("cpu"), world_size=world_size)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), expected[name], rtol=0, atol=1e-6, msg=name)


def test_non_finite_loss_names_the_step():
    model = _Tiny()
    with torch.no_grad():
        model.lm_head.bias.fill_(float("nan"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteLossError, match="step 7: the loss is nan") as info:
        train_step(model, [_batch([([1, 2], [2, 3])])], CrossEntropyLoss(), opt, device=torch.device("cpu"), step=7)
    assert "dtype=fp32" not in str(info.value)  # the run is fp32 already
    model.to(torch.bfloat16)
    with pytest.raises(NonFiniteLossError, match="or use dtype=fp32"):
        train_step(model, [_batch([([1, 2], [2, 3])])], CrossEntropyLoss(), opt, device=torch.device("cpu"), step=7)


def test_micro_batch_groups_drop_an_incomplete_last_group():
    assert list(micro_batch_groups(range(7), 3)) == [[0, 1, 2], [3, 4, 5]]


def test_out_of_memory_names_the_phase_and_the_flags_not_yet_set():
    cfg = {"batch_size": 8, "enable_activation_checkpointing": False, "lora": {"quantize_base": False},
           "optimizer": {"_component_": "torch.optim.AdamW"}, "dtype": "bf16", "tokenizer": {"max_seq_len": 4096}}
    with pytest.raises(OutOfMemory) as err:
        with oom_guard("forward/backward and optimizer step", cfg):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    message = str(err.value)
    assert message.startswith("out of memory during forward/backward and optimizer step")
    assert "enable_activation_checkpointing=true" in message and "lora.quantize_base=true (QLoRA)" in message
    assert "dtype=bf16" not in message  # already set
    assert "enable_activation_offloading=true" in memory_advice({**cfg, "enable_activation_checkpointing": True})
    assert "optimizer_offload=cpu" in message and "weight_offloading={type: block_level" in message
    assert "optimizer_offload=cpu" not in memory_advice({**cfg, "optimizer_offload": "cpu"})
    # a distributed config (its fsdp_reshard_after_forward key says so) offloads with fsdp_cpu_offload instead
    distributed = memory_advice({**cfg, "fsdp_reshard_after_forward": True, "fsdp_cpu_offload": False})
    assert "weight_offloading" not in " ".join(distributed) and "fsdp_cpu_offload=true" in distributed


def test_out_of_memory_ends_with_the_exact_fit_command():
    from mtune.training.memory.oom import set_invocation

    set_invocation("lora_single_device", "my config.yaml", ["batch_size=8", "lora.rank=16"])
    with pytest.raises(OutOfMemory) as err:
        with oom_guard("forward/backward and optimizer step", {"recipe": "lora_single_device"}):
            raise torch.OutOfMemoryError("CUDA out of memory")
    size = "SIZE" if not torch.cuda.is_available() else f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f}GiB"
    assert str(err.value).endswith(f"mtune plan --fit --device-memory {size} lora_single_device --config "
                                   "'my config.yaml' batch_size=8 lora.rank=16")


def test_build_loss_is_the_config_s_component_else_cross_entropy():
    """Mutation seen failing: build_loss ignoring its node (always cross-entropy)."""
    from mtune.modules.loss import ChunkedCrossEntropyLoss

    assert type(build_loss(None)) is CrossEntropyLoss
    chunked = build_loss({"_component_": "mtune.modules.loss.ChunkedCrossEntropyLoss", "num_chunks": 3})
    assert type(chunked) is ChunkedCrossEntropyLoss and chunked.num_chunks == 3

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

    def forward(self, tokens, input_pos=None, document_ids=None, return_hidden=False, longest_document=None):
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
    assert "a smaller batch_size with a larger gradient_accumulation_steps" in message
    # optimizer_in_bwd steps in each backward: its rule refuses accumulation, so the advice does not offer it
    in_backward = memory_advice({**cfg, "optimizer_in_bwd": True})
    assert "a smaller batch_size (not a larger gradient_accumulation_steps: optimizer_in_bwd=true cannot be combined " \
           "with gradient_accumulation_steps=2)" in in_backward


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


def _reference_grads(a, b):
    """Plain autograd over the summed token loss of both micro-batches / their 4 trained tokens (the oracle)."""
    reference = _Tiny()
    ce = nn.functional.cross_entropy
    summed = (ce(reference(a["tokens"])[0], a["labels"][0], reduction="sum")
              + ce(reference(b["tokens"])[0, 2:], b["labels"][0, 2:], reduction="sum"))
    (summed / 4).backward()
    return {n: (p.detach().clone(), p.grad.clone()) for n, p in reference.named_parameters()}


def test_fp16_loss_scale_is_divided_out_before_clipping():
    """fp16 loss scaling: the gradient is unscaled before its norm is taken and clipped (norm and update as fp32)."""
    from mtune.training.precision import LossScaler

    a = _batch([([1, 2, 3], [2, 3, 4])])
    b = _batch([([5, 6, 7], [-100, -100, 8])])
    reference = _reference_grads(a, b)
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for _, g in reference.values()])).item()
    max_norm = norm / 2  # clipping halves the update
    model = _Tiny()
    scaler = LossScaler("fp16", "cpu", init_scale=2.0**12)  # fp32 compute (no autocast): only the scale differs
    result = train_step(model, [a, b], CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=1.0),
                        device=torch.device("cpu"), loss_scaler=scaler, clip_grad_norm=max_norm, fp16=True)
    assert result.stepped and result.grad_norm == pytest.approx(norm, rel=1e-5)
    coef = max_norm / (norm + 1e-6)  # clip_grad_norm_'s factor
    for name, param in model.named_parameters():
        weight, grad = reference[name]
        torch.testing.assert_close(param.detach(), weight - coef * grad, rtol=0, atol=1e-6, msg=name)


def test_fp16_non_finite_loss_skips_the_step_instead_of_raising():
    """fp16: an inf/NaN loss is the loss scaler's to handle: no error, the step reported skipped, weights unchanged."""
    from mtune.training.precision import LossScaler

    model = _Tiny()
    with torch.no_grad():
        model.lm_head.bias.fill_(float("nan"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    scaler = LossScaler("fp16", "cpu", init_scale=1024.0)
    result = train_step(model, [_batch([([1, 2], [2, 3])])], CrossEntropyLoss(),
                        torch.optim.SGD(model.parameters(), lr=0.1), device=torch.device("cpu"),
                        loss_scaler=scaler, fp16=True, step=3)
    assert result.stepped is False and scaler.get_scale() == 512.0 and scaler.skipped_steps == 1
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), before[name], rtol=0, atol=0, equal_nan=True, msg=name)


def test_trained_tokens_count_labels_when_the_loss_averages_over_rows():
    """A loss with its own ``count`` (rows here, pairs for DPO) is averaged over it; trained_tokens stay label tokens."""

    class RowMean(nn.Module):  # sum over rows of each row's mean token loss; count: the rows
        @staticmethod
        def count(batch):
            return int(batch["tokens"].shape[0])

        def forward(self, logits, labels, lm_head):
            per_token = nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
            kept = (labels != -100).float()
            return ((per_token * kept).sum(1) / kept.sum(1)).sum(), torch.tensor(float(labels.shape[0]))

    a = _batch([([1, 2, 3], [2, 3, 4])])
    b = _batch([([5, 6, 7], [-100, -100, 8])])
    model = _Tiny()
    ce = nn.functional.cross_entropy
    with torch.no_grad():  # the mean over the 2 rows of each row's mean token loss
        expected = (ce(model(a["tokens"])[0], a["labels"][0]) + ce(model(b["tokens"])[0, 2:], b["labels"][0, 2:])) / 2
    result = train_step(model, [a, b], RowMean(), torch.optim.SGD(model.parameters(), lr=0.0),
                        device=torch.device("cpu"))
    assert result.trained_tokens == 4 and result.loss == pytest.approx(expected.item(), abs=1e-6)


def test_before_zero_grad_runs_while_the_step_s_gradients_exist():
    """``before_zero_grad`` sees every parameter's gradient (after the step); ``zero_grad`` frees them afterwards."""
    model = _Tiny()
    seen = []
    train_step(model, [_batch([([1, 2], [2, 3])])], CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1),
               device=torch.device("cpu"), before_zero_grad=lambda: seen.append([p.grad is not None
                                                                                  for p in model.parameters()]))
    assert seen == [[True, True, True]]
    assert all(p.grad is None for p in model.parameters())


def test_evaluate_is_the_token_weighted_mean_in_eval_mode_and_restores_the_mode():
    """evaluate: summed token loss over all batches / their trained tokens, dropout off, the caller's mode kept."""
    from mtune.training.loop import evaluate

    class Dropped(_Tiny):
        def __init__(self):
            super().__init__()
            self.drop = nn.Dropout(0.5)

        def forward(self, tokens, input_pos=None, document_ids=None, return_hidden=False, longest_document=None):
            return self.lm_head(self.drop(self.embed(tokens)))

    a = _batch([([1, 2, 3], [2, 3, 4])])
    b = _batch([([5, 6, 7], [-100, -100, 8])])
    model = Dropped()
    ce = nn.functional.cross_entropy
    with torch.no_grad():  # dropout is the identity in eval mode: the plain model's loss
        plain = _Tiny()
        expected = (ce(plain(a["tokens"])[0], a["labels"][0], reduction="sum")
                    + ce(plain(b["tokens"])[0, 2:], b["labels"][0, 2:], reduction="sum")).item() / 4
    torch.manual_seed(1)
    for training in (True, False):
        model.train(training)
        loss = evaluate(model, [a, b], CrossEntropyLoss(), device=torch.device("cpu"))
        assert loss == pytest.approx(expected, abs=1e-6) and model.training is training

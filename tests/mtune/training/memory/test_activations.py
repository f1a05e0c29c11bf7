"""Activation checkpointing, activation offloading and per-block compile: same numbers as the plain model, and
checkpointing's saving measured as bytes of tensors saved for backward."""

import contextlib
import copy

import pytest
import torch

from mtune.training.memory.registry import MemoryConfig
from mtune.models import build_model
from mtune.modules.loss import CrossEntropyLoss
from mtune.training.memory.techniques.activation_checkpointing.checkpoint import apply_activation_checkpointing
from mtune.training.memory.techniques.activation_offloading.offload import OffloadActivations, apply_activation_offloading
from tests._helpers.training import apply_memory_techniques
from mtune.training.placement import Placement
from mtune.training.observe.memory_stats import saved_for_backward_bytes
from tests._helpers.training import assert_close, assert_identical, loss_and_grads

gen = torch.Generator().manual_seed(7)
TOKENS = torch.randint(0, 512, (2, 64), generator=gen)
LABELS = torch.randint(0, 512, (2, 64), generator=gen)


def _model(n_layers=8):
    torch.manual_seed(0)
    return build_model("llama3_1", "tiny", device="cpu", n_layers=n_layers)


def _loss_and_grads(model, activation_context=None):
    return loss_and_grads(model, TOKENS, LABELS, activation_context)


def _saved_bytes(model):
    """Bytes of distinct storages autograd saves for backward during one forward."""
    return saved_for_backward_bytes(lambda: model(TOKENS).sum(), model)


_assert_identical = assert_identical


def test_checkpointing_is_exact_and_cuts_saved_activations():
    plain = _model()
    checkpointed = apply_activation_checkpointing(copy.deepcopy(plain))
    assert [k for k, _ in checkpointed.named_parameters()] == [k for k, _ in plain.named_parameters()]
    _assert_identical(_loss_and_grads(plain), _loss_and_grads(checkpointed))
    full, kept = _saved_bytes(plain), _saved_bytes(checkpointed)
    # Measured: 17.46 MiB -> 1.44 MiB (12.1x) on 8 layers, batch 2 x 64: what stays is each block's input plus the
    # embedding / final norm / lm_head activations; checkpointing every 2nd block keeps 9.45 MiB.
    assert full / kept >= 4
    every_other = _saved_bytes(apply_activation_checkpointing(copy.deepcopy(plain), every_n_layers=2))
    assert kept < every_other < full


def test_offloading_is_exact():
    plain = _model(n_layers=2)
    offloaded = copy.deepcopy(plain)
    ctx = apply_memory_techniques(offloaded, MemoryConfig(enable_activation_checkpointing=True,
                                                          enable_activation_offloading=True))
    _assert_identical(_loss_and_grads(apply_activation_checkpointing(plain)), _loss_and_grads(offloaded, ctx))
    assert ctx.offloaded_bytes == 0  # no CUDA: activations already in host memory, nothing moved


def test_offload_hooks_round_trip_through_host_copies():
    # On CPU nothing needs moving; a distinct placement makes the copies happen, as between a GPU and its host.
    plain = _model(n_layers=2)
    twin = copy.deepcopy(plain)
    placement = Placement("cpu", distinct=True)
    ctx = OffloadActivations(use_streams=False, min_offload_bytes=0, params=twin.parameters(), placement=placement)
    copies = []
    original = placement.to_compute
    placement.to_compute = lambda t, **kw: copies.append(placement.on_host(t)) or original(t, **kw)
    expected = _loss_and_grads(plain)
    with ctx:
        loss_sum, n = CrossEntropyLoss()(twin(TOKENS), LABELS)
    (loss_sum / n).backward()
    _assert_identical(expected, (loss_sum.detach(), {k: p.grad for k, p in twin.named_parameters()}))
    assert ctx.offloaded_bytes > 1 << 20
    assert copies and all(copies)  # backward read every saved tensor back from a host-resident copy


def test_compile_per_block_matches_eager():
    plain = _model(n_layers=1)  # compile on CPU is slow: one block
    compiled = copy.deepcopy(plain)
    lora = {"modules": ["q_proj", "v_proj"], "rank": 4, "alpha": 8}
    apply_memory_techniques(compiled, MemoryConfig(enable_activation_checkpointing=True, compile=True), lora=lora)
    apply_memory_techniques(plain, MemoryConfig(enable_activation_checkpointing=True), lora=lora)
    compiled.load_state_dict(plain.state_dict())
    assert_close(_loss_and_grads(plain), _loss_and_grads(compiled))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("use_streams", [False, True])
def test_offloading_on_cuda_moves_block_inputs_and_is_exact(use_streams):
    plain = _model(n_layers=2).cuda()
    offloaded = copy.deepcopy(plain)
    apply_activation_checkpointing(plain)
    apply_activation_checkpointing(offloaded)
    ctx = apply_activation_offloading(offloaded, use_streams=use_streams, min_offload_bytes=0)
    tokens, labels = TOKENS.cuda(), LABELS.cuda()

    def run(model, activation_context=None):
        with activation_context or contextlib.nullcontext():
            loss_sum, n = CrossEntropyLoss()(model(tokens), labels)
            (loss_sum / n).backward()
        return loss_sum.detach(), {k: p.grad for k, p in model.named_parameters()}

    _assert_identical(run(plain), run(offloaded, ctx))
    assert ctx.offloaded_bytes >= 2 * tokens.numel() * 256 * 4  # at least the two blocks' inputs


def test_a_tensor_saved_twice_is_copied_to_the_host_once(monkeypatch):
    ctx = OffloadActivations(use_streams=False, min_offload_bytes=0)
    monkeypatch.setattr(ctx, "_should_offload", lambda t: type(t) is torch.Tensor)
    x = torch.randn(64, 64, requires_grad=True)
    with ctx:
        y = torch.log_softmax(x, dim=-1)  # saves its output ...
        loss = torch.nn.functional.nll_loss(y, torch.zeros(64, dtype=torch.long))  # ... which nll_loss saves too
    loss.backward()
    expected = torch.autograd.grad(torch.nn.functional.nll_loss(torch.log_softmax(x, -1), torch.zeros(64,
                                   dtype=torch.long)), x)[0]
    assert torch.equal(x.grad, expected)
    # Saved: y by log_softmax and again by nll_loss (64x64 fp32, 16384 bytes), the target (512), total_weight (4).
    assert ctx.offloaded_bytes == 16384 + 512 + 4

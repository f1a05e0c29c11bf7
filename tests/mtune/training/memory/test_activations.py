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


def test_every_nth_block_from_the_first_is_checkpointed_as_the_planner_counts():
    """Guards which blocks every_n_layers checkpoints: 0, n, 2n, ... (what the planner's layer_policies assumes)."""
    from mtune.training.memory.techniques.activation_checkpointing import ActivationCheckpointingSettings
    from mtune.training.memory.techniques.activation_checkpointing.checkpoint import checkpoint_policy

    model = apply_activation_checkpointing(_model(n_layers=5), every_n_layers=2)
    assert [checkpoint_policy(b) for b in model.layers] == ["block", None, "block", None, "block"]
    s = ActivationCheckpointingSettings(enable_activation_checkpointing=True, activation_checkpointing_every_n_layers=2)
    assert s.layer_policies(5) == ("block", None, "block", None, "block")


def test_checkpointing_twice_keeps_the_first_policy_and_does_not_nest():
    """Guards against a second apply re-wrapping a block (a nested checkpoint, and the policy overwritten)."""
    from mtune.training.memory.techniques.activation_checkpointing.checkpoint import checkpoint_policy

    model = apply_activation_checkpointing(_model(n_layers=2))
    forwards = [b.forward for b in model.layers]
    apply_activation_checkpointing(model, policy="selective_op")
    assert [checkpoint_policy(b) for b in model.layers] == ["block", "block"]
    assert [b.forward for b in model.layers] == forwards


@pytest.mark.parametrize("every", [0, -1])
def test_every_n_layers_below_one_is_refused(every):
    """Guards the >= 1 check (0 would divide by zero, -1 would checkpoint every block)."""
    from mtune.config.errors import ConfigError

    with pytest.raises(ConfigError, match="activation_checkpointing_every_n_layers must be >= 1"):
        apply_activation_checkpointing(_model(n_layers=1), every_n_layers=every)


def test_every_nth_block_repeats_the_per_block_memory_every_n_blocks():
    """Guards the footprint's repeat_blocks: the planner's unit of blocks must hold whole checkpointing periods."""
    from mtune.training.memory import phases

    memory = MemoryConfig(enable_activation_checkpointing=True, activation_checkpointing_every_n_layers=3)
    assert 3 in phases.repeat_blocks(memory)
    assert max(phases.repeat_blocks(MemoryConfig())) == 1  # off: no period


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


@pytest.mark.parametrize("how", ["params", "model"])
def test_parameters_and_their_views_stay_in_place(how):
    """Guards the parameter-storage check (by ``params``, and by ``model`` read on entering): mm saves the weight's
    transpose, a view that is no Parameter, and only the input may go to the host."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(8, 64, requires_grad=True)
    kw = {"params": linear.parameters()} if how == "params" else {"model": linear}
    ctx = OffloadActivations(use_streams=False, min_offload_bytes=0, placement=Placement("cpu", distinct=True), **kw)
    with ctx:
        loss = linear(x).square().sum()  # square saves linear's output: an activation, offloaded too
    loss.backward()
    assert ctx.offloaded_bytes == (8 * 64 + 8 * 32) * 4  # x and y; never the 64 x 32 weight
    expected_x = 2 * (x.detach() @ linear.weight.detach().T) @ linear.weight.detach()  # d/dx sum((xW^T)^2)
    torch.testing.assert_close(x.grad, expected_x)


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

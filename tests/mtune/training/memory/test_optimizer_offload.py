"""optimizer_offload=cpu against the plain optimizer, through the real training step (accumulation and clipping):
bit-identical losses and parameters, states and gradients in host memory, no gradient left on the compute device.

On this CPU-only machine a ``Placement("cpu", distinct=True)`` makes every move a real copy and tells host storages
from compute-device ones, as between a GPU and its host."""

import copy

import pytest
import torch

from mtune.models import build_model
from mtune.modules.loss import CrossEntropyLoss
from mtune.training.loop import train_step
from tests._helpers.training import apply_memory_techniques
from mtune.training.memory.techniques.optimizer_offload.cpu_optimizer import CPUOffloadOptimizer
from mtune.training.optimizers import build_optimizer
from mtune.training.placement import Placement
from mtune.training.memory.registry import MemoryConfig

ADAMW = {"_component_": "torch.optim.AdamW", "lr": 3e-3, "weight_decay": 0.01}
gen = torch.Generator().manual_seed(3)
BATCHES = [{"tokens": torch.randint(0, 512, (1, 16), generator=gen),
            "labels": torch.randint(0, 512, (1, 16), generator=gen)} for _ in range(4)]
LORA = {"modules": ["q_proj", "v_proj", "down_proj"], "rank": 4, "alpha": 8}


def _model(lora=None, memory=MemoryConfig()):
    torch.manual_seed(0)
    model = build_model("llama3_1", "tiny", device="cpu", n_layers=2)
    if lora is not None or memory != MemoryConfig():
        apply_memory_techniques(model, memory, lora=lora)
    return model


def _train(model, optimizer, steps=2, accumulation=2, clip=1.0, context=None):
    losses = []
    for step in range(steps):
        micro = BATCHES[step * accumulation:(step + 1) * accumulation]
        with context or torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            result = train_step(model, micro, CrossEntropyLoss(), optimizer, device=torch.device("cpu"),
                                clip_grad_norm=clip, step=step + 1)
        losses.append((result.loss, result.grad_norm))
    return losses


def _assert_same_parameters(a, b):
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_offloaded_adamw_is_bit_identical_to_adamw(lora):
    plain = _model(lora)
    offloaded = copy.deepcopy(plain)
    placement = Placement("cpu", distinct=True)
    optimizer = build_optimizer(ADAMW, offloaded, MemoryConfig(optimizer_offload="cpu"), placement=placement)
    assert isinstance(optimizer, CPUOffloadOptimizer)
    expected = _train(plain, build_optimizer(ADAMW, plain))  # foreach AdamW on both sides
    assert _train(offloaded, optimizer) == expected  # loss and gradient norm (clipping reads host gradients)
    _assert_same_parameters(plain, offloaded)
    # The states and the optimizer's parameter copies are host memory; the model's parameters are not.
    states = [t for s in optimizer.state.values() for t in s.values() if t.numel() > 1]
    trainable = [p for p in offloaded.parameters() if p.requires_grad]
    assert len(states) == 2 * len(trainable) and all(placement.on_host(t) for t in states)
    assert all(placement.on_host(p) for p in optimizer.host_params)
    assert all(placement.on_compute(p) for p in offloaded.parameters())


def test_no_gradient_stays_on_the_compute_device_after_backward():
    model = _model()
    placement = Placement("cpu", distinct=True)
    optimizer = build_optimizer(ADAMW, model, MemoryConfig(optimizer_offload="cpu"), placement=placement)
    seen = []  # how many gradients the compute device holds each time one is complete
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _: seen.append(sum(q.grad is not None for q in model.parameters())))
    for batch in BATCHES[:2]:  # two micro-batches: the second is added to the first in host memory
        loss_sum, n = CrossEntropyLoss()(model(batch["tokens"]), batch["labels"])
        (loss_sum / n).backward()
        assert all(p.grad is None for p in model.parameters())
    # These hooks run after the optimizer's: by then the completed gradient has left, and no other one is held.
    assert len(seen) == 2 * len(list(model.parameters())) and max(seen) == 0
    grads = [h.grad for h in optimizer.host_params]
    assert all(g is not None and placement.on_host(g) for g in grads)
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert optimizer.moved_gradient_bytes == 2 * parameter_bytes


def test_resume_loads_the_plain_optimizers_state_and_refreshes_the_host_copies():
    plain = _model()
    plain_opt = build_optimizer(ADAMW, plain)
    _train(plain, plain_opt, steps=1)
    resumed = _model()
    resumed.load_state_dict(plain.state_dict())  # the checkpointer loads weights, then the optimizer state
    optimizer = build_optimizer(ADAMW, resumed, MemoryConfig(optimizer_offload="cpu"), placement=Placement("cpu", distinct=True))
    optimizer.load_state_dict(copy.deepcopy(plain_opt.state_dict()))  # as read back from recipe_state.pt
    assert all(torch.equal(h, p) for h, p in zip(optimizer.host_params, resumed.parameters()))
    plain_next, resumed_next = _train(plain, plain_opt, steps=1), _train(resumed, optimizer, steps=1)
    assert plain_next == resumed_next
    _assert_same_parameters(plain, resumed)


def test_resume_refreshes_host_copies_made_before_the_weights_were_loaded():
    """Guards load_state_dict copying the device parameters into the host copies (the optimizer built first)."""
    plain = _model()
    plain_opt = build_optimizer(ADAMW, plain)
    _train(plain, plain_opt, steps=1)
    resumed = _model()  # the initial weights: the host copies are taken from these
    optimizer = build_optimizer(ADAMW, resumed, MemoryConfig(optimizer_offload="cpu"),
                                placement=Placement("cpu", distinct=True))
    resumed.load_state_dict(plain.state_dict())
    optimizer.load_state_dict(copy.deepcopy(plain_opt.state_dict()))
    assert all(torch.equal(h, p) for h, p in zip(optimizer.host_params, plain.parameters()))
    assert _train(plain, plain_opt, steps=1) == _train(resumed, optimizer, steps=1)
    _assert_same_parameters(plain, resumed)


def test_stacks_with_checkpointing_and_activation_offloading():
    memory = MemoryConfig(enable_activation_checkpointing=True, enable_activation_offloading=True)
    plain = _model(LORA, memory)
    offloaded = copy.deepcopy(plain)
    placement = Placement("cpu", distinct=True)
    ctx = apply_memory_techniques(offloaded, MemoryConfig(enable_activation_offloading=True), placement=placement)
    ctx.min_offload_bytes = 0
    optimizer = build_optimizer(ADAMW, offloaded, MemoryConfig(optimizer_offload="cpu"), placement=placement)
    assert _train(offloaded, optimizer, context=ctx) == _train(plain, build_optimizer(ADAMW, plain))
    assert ctx.offloaded_bytes > 0
    _assert_same_parameters(plain, offloaded)


def test_an_optimizer_without_a_cpu_step_is_refused_when_the_validator_is_skipped():
    """Guards wrap_optimizer raising the rule's own words (build_optimizer called directly, no validator)."""
    from mtune.config.errors import ConfigError

    sgd = {"_component_": "torch.optim.SGD", "lr": 1e-2}
    with pytest.raises(ConfigError, match="cannot be combined with optimizer._component_=torch.optim.SGD"):
        build_optimizer(sgd, _model(), MemoryConfig(optimizer_offload="cpu"), placement=Placement("cpu", distinct=True))


def test_transfers_price_each_micro_batchs_gradients_and_one_copy_back_per_step():
    """Guards the footprint's transfer: gradients out every micro-batch, parameters back once per optimizer step."""
    from mtune.training.memory.technique import ModelFacts
    from mtune.training.memory.techniques.optimizer_offload import OPTIMIZER_OFFLOAD

    facts = ModelFacts(n_layers=2, dim=256, trainable_bytes=8e6, frozen_bytes=0, residual_bytes=4,
                       micro_batch_tokens=1000, step_tokens=4000, trainable_numel=2_000_000)
    memory = MemoryConfig(optimizer_offload="cpu")
    footprint = OPTIMIZER_OFFLOAD.footprint(memory[OPTIMIZER_OFFLOAD], memory, facts)
    assert footprint.transfer_bytes_per_token == pytest.approx(8e6 / 1000 + 8e6 / 4000)
    assert footprint.host_step_elements == 2_000_000 and footprint.states_home == "host"


def test_without_a_distinct_host_the_optimizer_runs_unchanged(caplog):
    model = _model()
    with caplog.at_level("INFO", logger="mtune"):
        optimizer = build_optimizer(ADAMW, model, MemoryConfig(optimizer_offload="cpu"), placement=Placement("cpu"))
    assert type(optimizer) is torch.optim.AdamW and "nothing is moved" in caplog.text


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_states_are_in_pinned_host_memory_and_the_step_matches_cpu_adamw():
    plain = _model().cuda()
    offloaded = copy.deepcopy(plain)
    optimizer = build_optimizer(ADAMW, offloaded, MemoryConfig(optimizer_offload="cpu"), placement=Placement("cuda"))
    assert optimizer.stream is not None
    reference = build_optimizer(dict(ADAMW, foreach=True), plain)  # the same AdamW arithmetic, on the GPU
    cuda = [{k: v.cuda() for k, v in b.items()} for b in BATCHES]
    for micro in (cuda[:2], cuda[2:4]):
        for model, opt in ((plain, reference), (offloaded, optimizer)):
            train_step(model, micro, CrossEntropyLoss(), opt, device=torch.device("cuda"), clip_grad_norm=1.0)
    for p, q in zip(plain.parameters(), offloaded.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    states = [t for s in optimizer.state.values() for t in s.values() if t.numel() > 1]
    assert all(t.device.type == "cpu" for t in states) and all(h.is_pinned() for h in optimizer.host_params)
    assert all(p.grad is None for p in offloaded.parameters())

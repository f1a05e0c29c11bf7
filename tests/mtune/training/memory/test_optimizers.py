"""Low-memory optimizers against torch.optim.AdamW, their state sizes, and optimizer-in-backward."""

import logging

import pytest
import torch
from torch import nn

from mtune.training import optimizers as optim_mod
from mtune.training.memory.techniques.optimizer_in_backward.in_backward import OptimizerInBackward
from mtune.training.optimizers import allocate_adamw_state, build_optimizer, optimizer_state_bytes
from mtune.training.memory.registry import MemoryConfig

LR = 1e-3
gen = torch.Generator().manual_seed(8)
X = torch.randn(32, 128, generator=gen)
Y = torch.randn(32, 128, generator=gen)


def _model():
    # Two weights of one shape (torchao compiles once per shape), 16384 elements: quantized by bnb and torchao.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 128, bias=False), nn.Tanh(), nn.Linear(128, 128, bias=False))


def _train(component, steps=10, **kwargs):
    model = _model()
    opt = build_optimizer({"_component_": component, "lr": LR, "weight_decay": 0.01}, model, **kwargs)
    losses = []
    for _ in range(steps):
        loss = (model(X) - Y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, opt, losses


def _drift(model, reference, start):
    """Distance to the reference run's parameters, relative to how far the reference moved them (L2 norms)."""
    diff = sum((p - r).square().sum() for p, r in zip(model.parameters(), reference.parameters())).sqrt()
    moved = sum((r - s).square().sum() for r, s in zip(reference.parameters(), start.parameters())).sqrt()
    return (diff / moved).item()


@pytest.fixture(scope="module")
def adamw():
    return _train("torch.optim.AdamW")


@pytest.mark.parametrize("component,state_ratio", [
    # Measured after 10 steps: drift 0.024 (bnb 8-bit), 0.023 (torchao 8-bit), 0.030 (torchao fp8); final loss
    # within 1.3e-4 / 1.3e-4 / 6.3e-4 relative of AdamW's; state 0.2695 / 0.2695 / 0.2539 of AdamW's fp32 state.
    ("bitsandbytes.optim.AdamW8bit", 0.27),
    ("torchao.optim.AdamW8bit", 0.27),
    ("torchao.optim.AdamWFp8", 0.26),
])
def test_8bit_optimizers_track_adamw(adamw, component, state_ratio):
    reference, ref_opt, ref_losses = adamw
    model, opt, losses = _train(component)
    assert _drift(model, reference, _model()) <= 0.05
    assert abs(losses[-1] - ref_losses[-1]) <= 1e-3 * ref_losses[-1]
    assert 0.25 <= optimizer_state_bytes(opt) / optimizer_state_bytes(ref_opt) <= state_ratio


def test_adamw4bit_state_and_falling_loss(adamw):
    _, ref_opt, _ = adamw
    _, opt, losses = _train("torchao.optim.AdamW4bit")
    ratio = optimizer_state_bytes(opt) / optimizer_state_bytes(ref_opt)
    assert 0.125 <= ratio <= 0.14  # measured 0.1338: 4-bit states (1/8 of fp32) plus their block scales
    assert losses[-1] < 0.9 * losses[0]


def test_paged_optimizer_runs_unpaged_on_cpu_and_says_so(adamw, caplog, monkeypatch):
    monkeypatch.setattr(optim_mod, "_warned_paging", False)
    reference, _, _ = adamw
    with caplog.at_level(logging.WARNING, logger="mtune.training.optimizers"):
        model, _, _ = _train("bitsandbytes.optim.PagedAdamW")
        _train("bitsandbytes.optim.PagedAdamW8bit", steps=1)
    assert sum("paging needs CUDA" in r.message for r in caplog.records) == 1  # once per process
    assert _drift(model, reference, _model()) <= 1e-5  # 32-bit paged AdamW = AdamW (measured 3e-7)


def test_optimizer_in_backward_equals_plain_step_with_one_gradient_alive(adamw):
    reference, ref_opt, _ = adamw
    model = _model()
    params = list(model.parameters())
    alive = []
    for p in params:  # registered first, so it runs before the optimizer's hook frees this gradient
        p.register_post_accumulate_grad_hook(lambda _: alive.append(sum(q.grad is not None for q in params)))
    opt = build_optimizer({"_component_": "torch.optim.AdamW", "lr": LR, "weight_decay": 0.01}, model,
                          MemoryConfig(optimizer_in_bwd=True))
    assert isinstance(opt, OptimizerInBackward)
    for _ in range(10):
        (model(X) - Y).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert max(alive) == 1 and len(alive) == 20
    for p, r in zip(model.parameters(), reference.parameters()):
        assert (p - r).abs().max().item() <= 1e-7

    # LR schedulers drive every inner optimizer; state round-trips.
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    assert scheduler.get_last_lr() == [LR * 0.5] * 2
    assert all(o.param_groups[0]["lr"] == LR * 0.5 for o in opt.optimizers.values())
    state = opt.state_dict()
    assert set(state) == {"0.weight", "2.weight"} and int(state["0.weight"]["state"][0]["step"]) == 10
    fresh = build_optimizer({"_component_": "torch.optim.AdamW", "lr": LR}, _model(), MemoryConfig(optimizer_in_bwd=True))
    fresh.load_state_dict(state)
    assert torch.equal(fresh.optimizers["0.weight"].state_dict()["state"][0]["exp_avg"],
                       state["0.weight"]["state"][0]["exp_avg"])


def test_unknown_optimizer_is_one_clear_line():
    with pytest.raises(ValueError, match="optimizer._component_='torch.optim.Adamw' cannot be imported"):
        build_optimizer({"_component_": "torch.optim.Adamw", "lr": 1.0}, _model())


@pytest.mark.parametrize("kwargs", [{"fused": True}, {"foreach": True}, {"foreach": False, "amsgrad": True}])
def test_adamw_states_made_up_front_train_bit_identically(kwargs):
    # build_optimizer makes AdamW's states before the first step (less fragmentation); the steps must not change
    model = _model()
    opt = build_optimizer({"_component_": "torch.optim.AdamW", "lr": LR, "weight_decay": 0.01, **kwargs}, model)
    assert all(set(s) >= {"step", "exp_avg", "exp_avg_sq"} and s["step"].item() == 0 for s in opt.state.values())
    reference = _model()
    lazy = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01, **kwargs)
    assert not lazy.state
    for _ in range(3):
        for m, o in ((model, opt), (reference, lazy)):
            (m(X) - Y).square().mean().backward()
            o.step()
            o.zero_grad()
    assert all(torch.equal(p, r) for p, r in zip(model.parameters(), reference.parameters()))
    for p, r in zip(model.parameters(), reference.parameters()):
        mine, theirs = opt.state[p], lazy.state[r]
        assert mine.keys() == theirs.keys()
        for key in mine:
            assert mine[key].device == theirs[key].device and mine[key].dtype == theirs[key].dtype, key
            assert torch.equal(mine[key], theirs[key]), key


def test_importing_the_training_loop_leaves_torchao_unloaded():
    # torchao loads torch._dynamo (~85 MiB resident): only NF4 (QLoRA) and its optimizers need it
    import subprocess
    import sys

    code = ("import sys, mtune.training.session, mtune.training.loop, mtune.modules.lora; "
            "print('torchao' in sys.modules, 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_adamw_is_fused_and_holds_state_for_trainable_parameters_only():
    """Over a model or a list of its parameters, only those with requires_grad are stepped and get state (a LoRA
    run's frozen base would get 8 bytes per weight); AdamW is fused on CPU unless configured; keyword overrides
    replace the config's; the state bytes are the two fp32 moments (4 bytes each), the step scalars left out."""
    model = _model()
    model[0].weight.requires_grad_(False)
    for params in (model, list(model.parameters())):
        opt = build_optimizer({"_component_": "torch.optim.AdamW", "lr": 1.0}, params, lr=LR)
        group = opt.param_groups[0]
        assert [id(p) for p in group["params"]] == [id(model[2].weight)]
        assert group["fused"] is True and group["lr"] == LR
        assert optimizer_state_bytes(opt) == 2 * 4 * 128 * 128


def test_in_backward_states_are_counted_and_made_states_are_kept():
    """optimizer_state_bytes reads optimizer-in-backward's per-parameter optimizers (2 moments x 4 bytes per weight
    once stepped); allocate_adamw_state leaves states a step already made as they are."""
    model = _model()
    opt = build_optimizer({"_component_": "torch.optim.AdamW", "lr": LR}, model, MemoryConfig(optimizer_in_bwd=True))
    (model(X) - Y).square().mean().backward()  # steps each parameter in backward
    assert optimizer_state_bytes(opt) == 2 * 2 * 4 * 128 * 128

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    (model(X) - Y).square().mean().backward()
    opt.step()
    before = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()}
    allocate_adamw_state(opt)
    for p, state in before.items():
        assert state["step"].item() == 1 and state["exp_avg"].abs().max() > 0
        assert all(torch.equal(opt.state[p][k], v) for k, v in state.items())


def test_optimizer_in_backward_resumes_with_the_lr_a_scheduler_sets():
    """Loaded state then an lr change (a scheduler's) reach every inner optimizer: 5 + 5 steps equal plain AdamW's."""
    kwargs = {"lr": LR, "weight_decay": 0.01}
    reference = _model()
    ref_opt = torch.optim.AdamW(reference.parameters(), **kwargs)
    model = _model()
    opt = OptimizerInBackward(model.named_parameters(), torch.optim.AdamW, **kwargs)
    for _ in range(5):
        (reference(X) - Y).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        (model(X) - Y).square().mean().backward()
    resumed = _model()
    resumed.load_state_dict(model.state_dict())
    opt.remove_hooks()
    fresh = OptimizerInBackward(resumed.named_parameters(), torch.optim.AdamW, **kwargs)
    fresh.load_state_dict(opt.state_dict())
    for group in (*ref_opt.param_groups, *fresh.param_groups):
        group["lr"] = LR / 2
    for _ in range(5):
        (reference(X) - Y).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        (resumed(X) - Y).square().mean().backward()
    for p, r in zip(resumed.parameters(), reference.parameters()):
        assert (p - r).abs().max().item() <= 1e-7
    with pytest.raises(ValueError, match=r"optimizer state lacks parameters \['2.weight'\]"):
        fresh.load_state_dict({"0.weight": fresh.state_dict()["0.weight"]})


def test_optimizer_in_backward_fit_choice_turns_clipping_off_and_says_so():
    """--fit's choice with optimizer_in_bwd drops clip_grad_norm (the rules refuse both), lossy only where it clipped."""
    from mtune.training.memory.registry import OPTIMIZER_IN_BACKWARD, RunKeys

    for clip, lossy in ((1.0, "optimizer_in_bwd drops gradient clipping"), (None, None)):
        memory = MemoryConfig(run=RunKeys(clip_grad_norm=clip))
        off, on = OPTIMIZER_IN_BACKWARD.fit_choices(memory[OPTIMIZER_IN_BACKWARD], memory, None)
        assert off.overrides == {"optimizer_in_bwd": False} and off.lossy is None
        assert on.overrides == {"optimizer_in_bwd": True, "clip_grad_norm": None} and on.lossy == lossy

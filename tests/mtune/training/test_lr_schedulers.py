import pytest
import torch

from mtune.training import lr_schedulers

transformers = pytest.importorskip("transformers")


def _optimizer(lr=3e-4):
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def _lrs(scheduler, optimizer, steps):
    values = []
    for _ in range(steps):
        values.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return values


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("get_cosine_schedule_with_warmup", dict(num_warmup_steps=5, num_training_steps=40)),
        ("get_cosine_schedule_with_warmup", dict(num_warmup_steps=0, num_training_steps=30, num_cycles=1.5)),
        ("get_cosine_schedule_with_warmup", dict(num_warmup_steps=10, num_training_steps=10)),
        ("get_constant_schedule_with_warmup", dict(num_warmup_steps=7)),
        ("get_linear_schedule_with_warmup", dict(num_warmup_steps=3, num_training_steps=20)),
    ],
)
def test_matches_transformers(name, kwargs):
    ours_opt, theirs_opt = _optimizer(), _optimizer()
    ours = getattr(lr_schedulers, name)(ours_opt, **kwargs)
    theirs = getattr(transformers, name)(theirs_opt, **kwargs)
    ours_lrs, theirs_lrs = _lrs(ours, ours_opt, 45), _lrs(theirs, theirs_opt, 45)
    assert ours_lrs == pytest.approx(theirs_lrs, abs=1e-15)
    assert ours_lrs[0] == (3e-4 if kwargs["num_warmup_steps"] == 0 else 0.0)


def test_state_dict_resumes_position():
    opt = _optimizer()
    sched = lr_schedulers.get_cosine_schedule_with_warmup(opt, num_warmup_steps=4, num_training_steps=20)
    _lrs(sched, opt, 9)
    state = sched.state_dict()
    expected = _lrs(sched, opt, 5)

    opt2 = _optimizer()
    sched2 = lr_schedulers.get_cosine_schedule_with_warmup(opt2, num_warmup_steps=4, num_training_steps=20)
    sched2.load_state_dict(state)
    opt2.param_groups[0]["lr"] = sched2.get_last_lr()[0]  # the optimizer's lr is restored from its own state
    assert _lrs(sched2, opt2, 5) == expected


def test_negative_warmup_is_refused():
    with pytest.raises(ValueError, match="lr_scheduler.num_warmup_steps must be >= 0"):
        lr_schedulers.get_constant_schedule_with_warmup(_optimizer(), num_warmup_steps=-1)


@pytest.mark.parametrize("name", ["get_cosine_schedule_with_warmup", "get_linear_schedule_with_warmup"])
def test_decaying_schedules_refuse_bad_step_counts(name):
    make = getattr(lr_schedulers, name)
    with pytest.raises(ValueError, match="num_warmup_steps must be >= 0, got -1"):
        make(_optimizer(), num_warmup_steps=-1, num_training_steps=10)
    with pytest.raises(ValueError, match="num_training_steps must be >= 1, got 0"):
        make(_optimizer(), num_warmup_steps=0, num_training_steps=0)

"""oom_recovery's decision (`replan`) on the tiny LoRA config, against whole plans of the answer (mtune plan, no
shortcut) and the budget formula; and the knobs a running model can take on."""

import logging

import pytest

from mtune._cli.catalog import find_recipe, load_recipe_module
from mtune._cli.run import load_and_check
from mtune.training.oom_recovery import adoptable_knobs, replan
from mtune.training.planning.candidates import with_overrides
from mtune.training.planning.plan import plan_memory
from tests._helpers.recipes import TRAIN_CONFIG, train_overrides, write_instruct_data, write_tiny_checkpoint

MIB = 2**20


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replan")
    overrides = train_overrides(tmp, write_tiny_checkpoint(tmp / "ckpt"), write_instruct_data(tmp / "d.jsonl"))
    return load_and_check(load_recipe_module(find_recipe("lora_single_device")), TRAIN_CONFIG, overrides,
                          "lora_single_device")


def _planned(cfg, changes, seq_len):
    return plan_memory(with_overrides(cfg, {**changes, "tokenizer.max_seq_len": seq_len})).device_total_bytes


def test_the_answer_fits_keeps_the_samples_and_the_budget_follows_what_the_run_held(cfg):
    """Between the plans of 2 and 4 rows per micro-batch (40 tokens), the answer is planned (whole) within the
    budget, keeps 4 samples per step and changes only what a running model can take on; a run that held twice its
    plan halves the budget (limit x plan / held). Mutations seen failing: the budget not scaled (``budget = limit``);
    adoptable_knobs returning every knob (the answer swaps the loss node)."""
    four, two = _planned(cfg, {}, 40), _planned(cfg, {"batch_size": 2, "gradient_accumulation_steps": 2}, 40)
    limit = (four + two) // 2
    answer = replan(cfg, limit=limit, longest_tokens=40, held_bytes=limit + 1)
    assert answer["current"] == four and answer["budget"] == limit  # the plan is above what the run held: as is
    changes = answer["changes"]
    assert set(changes) <= {"batch_size", "gradient_accumulation_steps", "enable_activation_checkpointing",
                            "activation_checkpointing_every_n_layers", "activation_checkpointing_policy",
                            "enable_activation_offloading"}, changes
    done = with_overrides(cfg, changes)
    assert done.batch_size * done.gradient_accumulation_steps == 4
    assert answer["planned"] == _planned(cfg, changes, 40) <= limit
    held_twice = replan(cfg, limit=limit, longest_tokens=40, held_bytes=2 * four)
    assert held_twice["budget"] == limit * four // (2 * four)


def test_where_nothing_fits_the_leanest_config_is_named_with_its_plan(cfg):
    """Under the weights alone nothing fits: the answer names the most saving adoptable config (one row per
    micro-batch, every block checkpointed and offloaded) with its whole plan."""
    answer = replan(cfg, limit=4 * MIB, longest_tokens=40, held_bytes=4 * MIB + 1)
    assert answer["changes"] is None
    assert answer["leanest"] == {"batch_size": 1, "enable_activation_checkpointing": True,
                                 "enable_activation_offloading": True, "gradient_accumulation_steps": 4}
    assert answer["leanest_bytes"] == _planned(cfg, answer["leanest"], 40)


def test_a_running_model_keeps_its_checkpointing_and_the_loaders_rows(cfg):
    """With every block checkpointed, no choice turns it off or thins it; micro-batches divide the loader's 4 rows,
    and every other knob keeps the config's choice. Mutation seen failing: _reachable always true."""
    on = with_overrides(cfg, {"enable_activation_checkpointing": True, "batch_size": 2,
                              "gradient_accumulation_steps": 2})
    knobs = {k.name: k.choices(on) for k in adoptable_knobs(on, rows=2)}
    assert sorted(c.overrides["batch_size"] for c in knobs["micro_batch"]) == [1, 2]
    checkpointing = [c.overrides for c in knobs["activation_checkpointing"]]
    assert all(o.get("enable_activation_checkpointing", True) and o.get("activation_checkpointing_every_n_layers", 1)
               == 1 for o in checkpointing), checkpointing
    assert any(o.get("enable_activation_offloading") for o in checkpointing)
    assert all(choices == [] or [c.overrides for c in choices] == [{}] for name, choices in knobs.items()
               if name not in ("micro_batch", "activation_checkpointing")), knobs


def test_the_recovered_config_is_the_file_mtune_run_fit_writes():
    """A resume reads one file whichever plan wrote it (`mtune run --fit`, or a recovery)."""
    from mtune._cli.run_fit import FIT_CONFIG_NAME
    from mtune.training.oom_recovery import RUN_CONFIG_NAME

    assert RUN_CONFIG_NAME == FIT_CONFIG_NAME == "mtune_fit.yaml"


class _Session:
    """What OomRecovery reads of a TrainingSession: the tiny LoRA config with a limit, a one-weight model on CPU."""

    def __init__(self, cfg, tmp_path, refused_bytes=None):
        import torch
        from types import SimpleNamespace

        from mtune.training.context import RunContext

        self.cfg = with_overrides(cfg, {"device_memory_limit": "1GiB"})
        self.run = RunContext(device=torch.device("cpu"), dtype_name="fp32", dtype=torch.float32, output_dir=tmp_path)
        tracker = None if refused_bytes is None else SimpleNamespace(device_limit=1, refused_bytes=refused_bytes)
        self.breakdown = SimpleNamespace(tracker=tracker, discard_step=lambda: None)
        self.model = torch.nn.Linear(3, 1, bias=False)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1.0)
        self.checkpointer = SimpleNamespace(config=None)
        self.activation_context = None
        self.saved = 0

    def save(self):
        self.saved += 1
        return None


def _rows(n):
    import torch

    return {"tokens": torch.arange(n * 3).view(n, 3), "labels": torch.arange(n * 3).view(n, 3)}


def _answer(**changes):
    return {"budget": 2**30, "current": 2**20, "seq_len": 3, "changes": changes or None, "planned": 2**20}


def test_a_step_out_of_memory_runs_again_halved_from_fresh_gradients(cfg, tmp_path, monkeypatch):
    """After an OOM before the optimizer step: the failed attempt's gradients dropped, the step (and the ones
    after it) run on micro-batches of the re-planned rows, the new config written for a resume."""
    import torch

    from mtune.training.oom_recovery import recovery as module

    monkeypatch.setattr(module, "replan", lambda cfg, **measured: _answer(batch_size=2, gradient_accumulation_steps=4))
    session = _Session(cfg, tmp_path)
    calls = []

    def step(micro_batches):
        calls.append(([int(b["tokens"].shape[0]) for b in micro_batches], session.model.weight.grad))
        if len(calls) == 1:  # half a backward done, then out of memory
            session.model(torch.ones(1, 3)).sum().backward()
            raise torch.OutOfMemoryError("device_memory_limit: over")
        return "done"

    recovery = module.OomRecovery(session, enabled=True)
    assert recovery.run(step, [_rows(4), _rows(4)], step=5) == "done"
    assert [c[0] for c in calls] == [[4, 4], [2, 2, 2, 2]] and calls[1][1] is None
    assert recovery.recoveries == 1 and session.cfg.batch_size == 2 and session.checkpointer.config["batch_size"] == 2
    assert (tmp_path / "mtune_fit.yaml").read_text().startswith("# Written by oom_recovery at step 5")
    assert recovery.run(step, [_rows(4), _rows(2)], step=6) == "done"  # the rows chosen stay; 2 rows are left whole
    assert calls[2][0] == [2, 2, 1, 1]


def test_an_oom_after_the_optimizer_stepped_is_not_retried_and_the_retries_are_bounded(cfg, tmp_path, monkeypatch,
                                                                                      caplog):
    """Parameters already changed: re-raised, never run twice. Else at most MAX_RECOVERIES re-plans, then the run
    saves and ends."""
    import torch

    from mtune.training.memory.oom import OutOfMemory
    from mtune.training.oom_recovery import MAX_RECOVERIES
    from mtune.training.oom_recovery import recovery as module

    monkeypatch.setattr(module, "replan", lambda cfg, **measured: _answer(batch_size=4, gradient_accumulation_steps=2))
    session = _Session(cfg, tmp_path)
    recovery = module.OomRecovery(session, enabled=True)

    def after_the_step(micro_batches):
        session.optimizer.step()
        raise torch.OutOfMemoryError("after the step")

    with caplog.at_level(logging.WARNING, logger="mtune"), pytest.raises(torch.OutOfMemoryError, match="after the step"):
        recovery.run(after_the_step, [_rows(4)], step=1)
    assert recovery.recoveries == 0
    assert [r.getMessage() for r in caplog.records] == [  # why this one is not re-planned (the sweep met it unsaid)
        "oom_recovery: not re-planned: the optimizer had begun its step (optimizer_in_bwd steps during backward), "
        "so this step cannot run again"]
    calls = []

    def always(micro_batches):
        calls.append(1)
        raise torch.OutOfMemoryError("always")

    with pytest.raises(OutOfMemory, match=f"step 2 \\(always\\) and oom_recovery cannot go on: {MAX_RECOVERIES} re-plans"):
        recovery.run(always, [_rows(4)], step=2)
    assert len(calls) == MAX_RECOVERIES + 1 and session.saved == 1


def test_giving_up_names_the_limit_the_leanest_plan_needs_scaled_by_what_the_run_held(cfg, tmp_path, monkeypatch):
    """The run held twice its plan (2 MiB held, 1 MiB planned): the leanest plan's 3 MiB needs about 6 MiB."""
    import torch

    from mtune.training.memory.oom import OutOfMemory
    from mtune.training.oom_recovery import recovery as module

    leanest = {"batch_size": 1, "gradient_accumulation_steps": 8}
    monkeypatch.setattr(module, "replan", lambda cfg, **measured: {
        **_answer(), "leanest": leanest, "leanest_bytes": 3 * 2**20, "floor": "the weights alone are over it"})
    session = _Session(cfg, tmp_path, refused_bytes=2 * 2**20)

    def oom(micro_batches):
        raise torch.OutOfMemoryError("over")

    with pytest.raises(OutOfMemory, match=r"planned at 3.0 MiB for rows of 3 tokens, so a device_memory_limit of "
                                          r"about 6.0 MiB would fit it; saved the last whole step, 6$"):
        module.OomRecovery(session, enabled=True).run(oom, [_rows(4)], step=7)

"""oom_recovery's decision (`replan`) on the tiny LoRA config, against whole plans of the answer (mtune plan, no
shortcut) and the budget formula; and the knobs a running model can take on."""

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

"""Every flag set of the shipped training configs, planned on its family's tiny model, gives the bytes recorded in
``tests/assets/plans/shipped_flag_sets.json``: a change to how techniques are declared, applied or planned that
moves any planned figure fails here. The figures were recorded by the planner before the memory techniques moved
into their own modules; regenerate them (``MTUNE_RECORD_PLANS=1 pytest tests/recipes/test_plan_shipped_flag_sets.py``)
only for a change meant to move a plan, and say why in the commit."""

import json
import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from mtune._cli.catalog import find_config, find_recipe, load_recipe_module
from mtune._cli.run import load_and_check
from mtune.training.planning.plan import plan_memory

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "assets" / "plans" / "shipped_flag_sets.json"
# Keys that say nothing about memory: configs that differ only in these (and in the model) share a flag set.
_NOT_FLAGS = {"model", "tokenizer", "output_dir", "dataset", "dataset_val", "metric_logger", "profiler", "task_eval",
              "seed", "epochs", "max_steps_per_epoch", "log_every_n_steps", "save_every_n_steps",
              "keep_last_n_checkpoints", "lr_scheduler", "eval_every_n_steps", "resume_from_checkpoint", "plan_check",
              "memory_breakdown"}


def _flag_sets() -> list[str]:
    """The first shipped training config (by name) of each distinct flag set."""
    first = {}
    for path in sorted((REPO / "recipes" / "configs").glob("*/*.yaml")):
        if "single_device" not in path.name and "distributed" not in path.name:
            continue
        node = OmegaConf.to_container(OmegaConf.load(path))
        flags = json.dumps({k: v for k, v in node.items() if k not in _NOT_FLAGS}, sort_keys=True)
        first.setdefault(flags, str(path.relative_to(REPO / "recipes" / "configs").with_suffix("")))
    return sorted(first.values())


CONFIGS = _flag_sets()


def shipped_on_tiny(config: str):
    """``(recipe module, overrides, cfg)``: the shipped ``config`` on its family's tiny model (random weights, a
    CUDA target, rows of 64 tokens)."""
    family = config.split("/")[0]
    text = (REPO / "recipes" / "configs" / f"{config}.yaml").read_text()
    recipe = next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("recipe:"))
    overrides = ["device=cuda", "tokenizer.path=null", "tokenizer.max_seq_len=64"]
    if family != "tiny":
        overrides += ["model.checkpoint_dir=null", f"model.family={family}", "model.size=tiny"]
    module = load_recipe_module(find_recipe(recipe))
    return module, overrides, load_and_check(module, find_config(config), overrides)


def _plan(config: str) -> dict:
    _, _, cfg = shipped_on_tiny(config)
    world_size = 2 if "distributed" in str(cfg.recipe) else 1
    plan = plan_memory(cfg, world_size=world_size)
    return {"device_peak_bytes": plan.device_peak_bytes, "host_peak_bytes": plan.host_peak_bytes,
            "device": plan.device, "host": plan.host}


@pytest.fixture(scope="module")
def golden():
    if os.environ.get("MTUNE_RECORD_PLANS"):
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps({c: _plan(c) for c in CONFIGS}, indent=1, sort_keys=True) + "\n")
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("config", CONFIGS)
def test_shipped_flag_set_plans_as_recorded(config, golden):
    assert config in golden, f"{config} has no recorded plan: record it (see the module docstring)"
    assert _plan(config) == golden[config]

"""The shipped training configs that differ in how they use memory, and a shipped config on its family's tiny model
(what the planner tests plan and --fit searches)."""

import json

from omegaconf import OmegaConf

from mtune._cli.catalog import find_config, find_recipe, load_recipe_module
from mtune._cli.run import load_and_check
from tests._helpers.paths import REPO

# Keys that say nothing about memory: configs that differ only in these (and in the model) share a flag set.
_NOT_FLAGS = {"model", "tokenizer", "output_dir", "dataset", "dataset_val", "metric_logger", "profiler", "task_eval",
              "seed", "epochs", "max_steps_per_epoch", "log_every_n_steps", "save_every_n_steps",
              "keep_last_n_checkpoints", "lr_scheduler", "eval_every_n_steps", "resume_from_checkpoint", "plan_check",
              "memory_breakdown"}


RECORDED = REPO / "tests" / "assets" / "plans" / "shipped_flag_sets.json"


def _flag_sets() -> list[str]:
    """One shipped training config of each distinct flag set: the one whose plan is recorded in
    ``tests/assets/plans/shipped_flag_sets.json`` if any (so a family added later, whose name sorts first, does not
    take over a recorded flag set), else the first by name."""
    recorded = set(json.loads(RECORDED.read_text())) if RECORDED.exists() else set()
    chosen = {}
    for path in sorted((REPO / "recipes" / "configs").glob("*/*.yaml")):
        if "single_device" not in path.name and "distributed" not in path.name:
            continue
        node = OmegaConf.to_container(OmegaConf.load(path))
        flags = json.dumps({k: v for k, v in node.items() if k not in _NOT_FLAGS}, sort_keys=True)
        name = str(path.relative_to(REPO / "recipes" / "configs").with_suffix(""))
        if flags not in chosen or (name in recorded and chosen[flags] not in recorded):
            chosen[flags] = name
    return sorted(chosen.values())


FLAG_SETS = _flag_sets()
"""The shipped training configs, one per distinct flag set (named like ``llama3_1/8B_lora_single_device``)."""


def shipped_on_tiny(config: str, *extra: str):
    """``(recipe module, overrides, cfg)``: the shipped ``config`` on its family's tiny model (random weights, a
    CUDA target, rows of 64 tokens), with the ``extra`` overrides after those."""
    family = config.split("/")[0]
    text = (REPO / "recipes" / "configs" / f"{config}.yaml").read_text()
    recipe = next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("recipe:"))
    overrides = ["device=cuda", "tokenizer.path=null", "tokenizer.max_seq_len=64"]
    if family != "tiny":
        overrides += ["model.checkpoint_dir=null", f"model.family={family}", "model.size=tiny"]
    overrides += extra
    module = load_recipe_module(find_recipe(recipe))
    return module, overrides, load_and_check(module, find_config(config), overrides)

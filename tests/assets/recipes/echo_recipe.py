"""Test recipe: builds cfg.component and writes it, with the config it received, to output_dir/echo.json."""

import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from mtune.config import KeyGroup, Node, RecipeSchema, instantiate
from mtune.config.keys import RUN_KEYS
from mtune.config.rules import RUN_RULES
from mtune.training.memory.registry import MEMORY_KEYS, MEMORY_RULES

SCHEMA = RecipeSchema(
    [RUN_KEYS, MEMORY_KEYS, KeyGroup("echo", [Node("component", "any _component_ to build", required=True)])],
    rules=RUN_RULES + MEMORY_RULES,
)


def main(cfg: DictConfig) -> None:
    built = instantiate(cfg.component)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = {"built": str(built), "cfg": OmegaConf.to_container(cfg, resolve=True)}
    (out / "echo.json").write_text(json.dumps(result))

"""Finding built-in recipes and configs, and loading a recipe file as a module (no torch import here)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import yaml

from mtune.config.errors import did_you_mean
from mtune._cli.errors import CliError

RECIPES_DIR_ENV = "MTUNE_RECIPES_DIR"


def recipes_dir() -> Path:
    """The built-in ``recipes/`` folder: ``$MTUNE_RECIPES_DIR`` when set, else the one installed next to mtune."""
    if os.environ.get(RECIPES_DIR_ENV):
        return Path(os.environ[RECIPES_DIR_ENV])
    beside = Path(__file__).resolve().parents[2] / "recipes"
    if beside.is_dir():
        return beside
    spec = importlib.util.find_spec("recipes")  # finds the package without running it
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    raise CliError("cannot find mtune's built-in recipes folder", f"reinstall mtune or set {RECIPES_DIR_ENV}")


def builtin_recipes(root: Path | None = None) -> dict[str, Path]:
    """Recipe name -> file, for every ``recipes/*.py`` not starting with ``_``."""
    root = root or recipes_dir()
    return {p.stem: p for p in sorted(root.glob("*.py")) if not p.name.startswith("_")}


def builtin_configs(root: Path | None = None) -> dict[str, Path]:
    """Config name (``llama3_2/1B_lora_single_device``) -> file, for every ``recipes/configs/**/*.yaml``."""
    configs = (root or recipes_dir()) / "configs"
    return {p.relative_to(configs).with_suffix("").as_posix(): p for p in sorted(configs.rglob("*.yaml"))}


def configs_by_recipe(root: Path | None = None) -> dict[str, list[str]]:
    """Recipe name -> names of the built-in configs whose top-level ``recipe:`` key names it."""
    table: dict[str, list[str]] = {}
    for name, path in builtin_configs(root).items():
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError:
            data = None
        recipe = data.get("recipe") if isinstance(data, dict) else None
        table.setdefault(recipe if isinstance(recipe, str) else "(no recipe: key)", []).append(name)
    return table


def find_recipe(name_or_path: str) -> Path:
    """A built-in recipe by name, or the path of the user's own recipe file."""
    recipes = builtin_recipes()
    if name_or_path in recipes:
        return recipes[name_or_path]
    path = Path(name_or_path)
    if path.suffix == ".py" and path.is_file():
        return path.resolve()
    raise CliError(
        f"no recipe named '{name_or_path}'{did_you_mean(name_or_path, recipes)}",
        "`mtune ls` lists the built-in recipes; a recipe of your own is given by its .py path",
    )


def find_config(name_or_path: str) -> Path:
    """A built-in config by name (``.yaml`` optional), or the path of a YAML file."""
    path = Path(name_or_path)
    if path.is_file():
        return path.resolve()
    configs = builtin_configs()
    name = name_or_path[:-5] if name_or_path.endswith(".yaml") else name_or_path
    if name in configs:
        return configs[name]
    if path.is_dir():
        yamls = sorted(p.name for p in path.glob("*.yaml"))[:3]
        raise CliError(f"{name_or_path} is a directory, not a config file",
                       f"name a YAML file in it (such as {', '.join(yamls)})" if yamls else "name a YAML config file")
    raise CliError(
        f"no config file or built-in config named '{name_or_path}'{did_you_mean(name, configs)}",
        "`mtune ls` lists the built-in configs",
    )


def is_training_recipe(module: ModuleType) -> bool:
    """Whether a recipe module trains: its SCHEMA declares the training keys (`mtune.config.keys.TRAINING_NODES`,
    ``plan_check`` among them). Only those are planned (`mtune plan`, ``--fit``) and given a run's end-of-run
    lines; generate and merge_lora train nothing."""
    return hasattr(module, "SCHEMA") and "plan_check" in module.SCHEMA.keys


def load_recipe_module(path: Path) -> ModuleType:
    """Import the recipe file at ``path`` and check it keeps the recipe contract (``SCHEMA`` and ``main``)."""
    from mtune.config import RecipeSchema

    module_name = f"mtune_recipe_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise CliError(f"cannot load recipe file {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up by name
    spec.loader.exec_module(module)
    if not callable(getattr(module, "main", None)):
        raise CliError(f"recipe {path} defines no main(cfg) function", "see docs/cli.md, 'The recipe contract'")
    if not isinstance(getattr(module, "SCHEMA", None), RecipeSchema):
        raise CliError(f"recipe {path} defines no SCHEMA (a RecipeSchema)", "see docs/cli.md, 'The recipe contract'")
    return module

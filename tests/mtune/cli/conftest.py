"""Run the real `mtune` entry point in a subprocess against a recipes folder built from tests/assets."""

import os
import shutil
import subprocess
import sys

import pytest

from tests._helpers.paths import REPO

ASSETS = REPO / "tests" / "assets"


@pytest.fixture(scope="module")
def recipes_root(tmp_path_factory):
    """A stand-in for the built-in recipes/ folder: the test recipes, their configs under configs/test/, and one
    config naming a recipe that does not exist."""
    root = tmp_path_factory.mktemp("recipes")
    for recipe in (ASSETS / "recipes").glob("*.py"):
        shutil.copy(recipe, root / recipe.name)
    (root / "configs" / "test").mkdir(parents=True)
    for config in (ASSETS / "configs").glob("*.yaml"):
        shutil.copy(config, root / "configs" / "test" / config.name)
    (root / "configs" / "other").mkdir()
    (root / "configs" / "other" / "orphan.yaml").write_text("recipe: ghost_recipe\noutput_dir: /tmp/x\n")
    return root


@pytest.fixture(scope="module")
def mtune(recipes_root):
    def run(*args, cwd=None, **env_changes):
        env = {**os.environ, "PYTHONPATH": str(REPO), "MTUNE_RECIPES_DIR": str(recipes_root), "MTUNE_DEBUG": "0"}
        env.update(env_changes)
        return subprocess.run(
            [sys.executable, "-m", "mtune", *map(str, args)], env=env, cwd=cwd, capture_output=True, text=True,
            timeout=120,
        )

    return run

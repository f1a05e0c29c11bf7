"""Where the repository is, for tests that run its files (recipes, configs, the CLI) from anywhere."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

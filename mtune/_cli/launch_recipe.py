"""Per-rank entry point under torchrun: ``python -m mtune._cli.launch_recipe RECIPE_PATH --config CONFIG ...``."""

from __future__ import annotations

import sys
from pathlib import Path

from mtune._cli.errors import UsageError
from mtune._cli.main import handle_errors
from mtune._cli.rank_failures import record_rank_failure
from mtune._cli.run import parse_run_args, run_recipe


def launch(argv: list[str]) -> int:
    args = parse_run_args(argv)
    if args.config is None:
        raise UsageError("missing --config")
    try:
        run_recipe(Path(args.recipe), Path(args.config), args.overrides)
    except BaseException as err:  # what ended this rank, for `mtune run`'s summary when ranks fail
        record_rank_failure(err)
        raise
    return 0


def run_recipe_file(recipe_file: str) -> None:
    """Let a recipe run as a script: ``python recipes/lora_single_device.py --config ... key=value``."""
    sys.exit(handle_errors(launch, [recipe_file, *sys.argv[1:]]))


if __name__ == "__main__":
    sys.exit(handle_errors(launch, sys.argv[1:]))

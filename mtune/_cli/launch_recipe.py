"""Per-rank entry point under torchrun: ``python -m mtune._cli.launch_recipe RECIPE_PATH --config CONFIG ...``."""

from __future__ import annotations

import atexit
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import NoReturn

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
        if record_rank_failure(err) and os.environ.get("MTUNE_DEBUG") != "1":  # the summary prints it, once
            raise SystemExit(getattr(err, "exit_code", 1)) from None
        raise
    return 0


def run_recipe_file(recipe_file: str) -> None:
    """Let a recipe run as a script: ``python recipes/lora_single_device.py --config ... key=value``."""
    sys.exit(handle_errors(launch, [recipe_file, *sys.argv[1:]]))


def leave(code: int) -> NoReturn:
    """End a torchrun worker as a normal exit would, but without the interpreter's teardown: the atexit callbacks
    run (the output lock, loggers), the streams are flushed, then the process exits at once.

    After a distributed run, objects in torch's own caches (DTensor's sharding and redistribute caches, the device
    meshes they keep) still hold the process group, whose gloo threads keep running past ``destroy_process_group``;
    the interpreter's teardown then freed the group while those threads and the rest of the process were torn down,
    which now and then aborted a rank that had trained and saved (``terminate called without an active exception``,
    exit status 1). Nothing is left to do by then: every file is written and closed."""
    try:
        atexit._run_exitfuncs()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _main(argv: list[str]) -> int:
    try:
        return handle_errors(launch, argv)
    except SystemExit as err:
        return err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
    except BaseException:  # a bug keeps its traceback, printed as Python would
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    leave(_main(sys.argv[1:]))

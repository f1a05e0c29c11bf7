"""The ``mtune`` command: ``run``, ``ls``, ``cp``, ``validate``, ``download``, ``plan``.

Only this module, argparse and the light command modules load at start-up; torch is imported by the recipe a
command runs, never here. Every error is one line (``error: ...`` and maybe ``hint: ...``) with exit status 1, or 2
for a bad command line; ``MTUNE_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

USAGE = """\
usage: mtune <command> [options]

PyTorch-native fine-tuning recipes for LLMs.

commands:
  run        run a recipe with a config:  mtune run lora_single_device --config llama3_2/1B_lora_single_device
  ls         list the built-in recipes and their configs
  cp         copy a built-in recipe or config to edit it:  mtune cp llama3_2/1B_lora_single_device my.yaml
  validate   check a config without running it:  mtune validate my.yaml
  plan       predict a config's peak memory, or find one that fits:  mtune plan --device-memory 24GiB --fit \
             full_single_device --config llama3_1/8B_full_single_device
  download   download a model from the Hugging Face Hub:  mtune download meta-llama/Llama-3.2-1B-Instruct

`mtune <command> --help` describes each; MTUNE_DEBUG=1 shows tracebacks.
"""


def _commands() -> dict[str, Callable[[list[str]], int]]:
    from mtune._cli.commands import cp_command, ls_command, validate_command
    from mtune._cli.download import download_command
    from mtune._cli.plan import plan_command
    from mtune._cli.run import run_command

    return {"run": run_command, "ls": ls_command, "cp": cp_command, "validate": validate_command,
            "download": download_command, "plan": plan_command}


def dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    if argv[0] == "--version":
        from mtune import __version__

        print(f"mtune {__version__}")
        return 0
    commands = _commands()
    if argv[0] not in commands:
        from mtune._cli.errors import UsageError
        from mtune.config.errors import did_you_mean

        raise UsageError(f"unknown command '{argv[0]}'{did_you_mean(argv[0], commands)}", "`mtune --help` lists them")
    return commands[argv[0]](argv[1:])


def handle_errors(function: Callable[[list[str]], int], argv: list[str]) -> int:
    """Run ``function(argv)`` and turn a user-facing error into one line on stderr and an exit status.

    Every `MtuneError` (config, data, checkpoint, resume, adapter, non-finite loss, out of memory, CLI) is printed
    as ``error: ...`` / ``hint: ...``; other exceptions are bugs or unforeseen failures and keep their traceback.
    ``MTUNE_DEBUG=1`` shows the traceback of every error."""
    from mtune.errors import MtuneError

    try:
        return function(argv)
    except MtuneError as err:
        if os.environ.get("MTUNE_DEBUG") == "1":
            raise
        print(f"error: {err}", file=sys.stderr)
        if err.hint:
            print(f"hint: {err.hint}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point (``mtune``)."""
    try:
        return handle_errors(dispatch, sys.argv[1:] if argv is None else list(argv))
    except BrokenPipeError:  # `mtune ... | head`: the reader left; end quietly, as a tool killed by SIGPIPE does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so exit's flush does not raise again
        return 128 + 13

"""The end of a ``--fit`` answer (``--maximize`` too): what the answer gives up or how its numbers compare with the
config's, and the config written with its changes."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from mtune.config import load_config
from mtune.errors import MtuneError
from mtune.training.memory import phases
from mtune.training.memory.registry import MemoryConfig
from mtune.training.planning.candidates import Candidate, describe

__all__ = ["close_answer", "numerics_line", "write_config", "AnswerNotWritten"]


class AnswerNotWritten(MtuneError, OSError):
    """The config a ``--fit`` found could not be written where it was asked to go (the message names the path
    and the operating system's reason)."""


def close_answer(cfg, answer: Candidate, changes: dict, lossy_head: str, *, recipe: str, config_path: Path,
                 overrides: list[str], output: Path) -> int:
    """The last lines of a ``--fit`` answer (``--maximize`` too): what the answer gives up (after ``lossy_head``,
    which says why) or how its numbers compare with ``cfg``'s; then the user's config with ``changes`` written to
    ``output``, and the command that runs it. Returns the exit status, 0."""
    print(f"  {lossy_head}gives up " + ", ".join(answer.lossy) if answer.lossy
          else "  " + numerics_line(cfg, answer.cfg))
    write_config(config_path, overrides, changes, output)
    print(f"written to {output}; run it with:\n  mtune run {recipe} --config {output}")
    return 0


def numerics_line(cfg, answer_cfg) -> str:
    """Whether a lossless answer computes the config's own numbers, or more precise ones: a technique that is
    lossy in ``cfg`` (an NF4 or fp8 base) and not in ``answer_cfg`` was dropped because its memory is not needed,
    or traded for a more precise one (an fp8 base for an NF4 one)."""
    mine, answers = MemoryConfig.from_config(cfg), MemoryConfig.from_config(answer_cfg)
    dropped, instead = phases.dropped_losses(mine, answers), phases.dropped_losses(answers, mine)
    if dropped and instead:
        return (f"more precise than the config: {', '.join(instead)} where it had {', '.join(dropped)} (not the "
                "same numbers, nothing given up)")
    if dropped:
        return (f"more precise than the config: no {', '.join(dropped)} (it fits without: not the same numbers, "
                "nothing given up)")
    return "lossless: the same numbers as the config"


def write_config(config_path: Path, overrides: list[str], changes: dict, output: Path) -> Path:
    """The user's config with their overrides and the fit's changes (a node replaced whole), interpolations kept,
    as YAML."""
    cfg = load_config(config_path, overrides)
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value, merge=False, force_add=True)
    header = f"# Written by `mtune plan --fit` from {config_path}; changed: {describe(changes)}\n"
    output = Path(output)
    try:
        output.write_text(header + OmegaConf.to_yaml(cfg))
    except OSError as err:  # `mtune plan` checks --output before its search; this is what it could not foresee
        raise AnswerNotWritten(f"cannot write the config --fit found to {output}: {err.strerror or err}",
                               "name a file in a directory you can write (`mtune plan --fit`: --output FILE)") from err
    return output

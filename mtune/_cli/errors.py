"""Errors the CLI turns into one readable line and an exit status."""

from __future__ import annotations

from mtune.errors import MtuneError


class CliError(MtuneError):
    """A failure of a CLI command the user can act on: printed as ``error: <message>`` (+ ``hint: ...``), exit
    status 1."""


class UsageError(CliError):
    """The command line itself is wrong: exit status 2."""

    exit_code = 2

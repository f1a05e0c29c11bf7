"""Errors the CLI turns into one readable line and an exit status."""

from __future__ import annotations


class CliError(Exception):
    """A failure the user can act on: printed as ``error: <message>`` (+ ``hint: ...``), exit status 1."""

    exit_code = 1

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


class UsageError(CliError):
    """The command line itself is wrong: exit status 2."""

    exit_code = 2

"""The base of every error mtune raises for something the user can fix.

The CLI prints an `MtuneError` as one line, ``error: <message>``, plus ``hint: <what to do>`` when there is a hint,
and exits with ``exit_code`` (1; 2 for a bad command line); ``MTUNE_DEBUG=1`` shows the traceback instead. Each
subclass also derives from the built-in exception it refines (``ValueError``, ``RuntimeError``, ``OSError``), so
code that caught those keeps working. No imports here: the CLI loads this module at start-up.
"""

from __future__ import annotations

__all__ = ["MtuneError", "PathNotFoundError", "OutputExistsError"]


class MtuneError(Exception):
    """A failure the user can act on. ``str(err)`` is one line naming the key, file or row; ``err.hint`` (may be
    empty) says what to change."""

    exit_code = 1

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


class PathNotFoundError(MtuneError, FileNotFoundError):
    """A file or directory the config names does not exist (or is not what it should be); the message names it."""


class OutputExistsError(MtuneError, FileExistsError):
    """Writing would destroy results that are already there; the message names the directory."""

"""The error every config problem raises, and the helper that suggests a close name."""

from __future__ import annotations

import difflib
from typing import Iterable

from mtune.errors import MtuneError


class ConfigError(MtuneError, ValueError):
    """A problem in a config or its overrides that the user can fix.

    ``str(err)`` is one line naming the key; ``err.hint`` (may be empty) says what to do.
    """


class ComponentError(ConfigError):
    """A config's ``_component_`` raised inside its own call: the message names the key, the target and the error
    (``MTUNE_DEBUG=1`` shows the traceback, chained from the original exception)."""


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate most like ``name`` (difflib ratio >= 0.6), or None."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` when a candidate is close to ``name``, else ``''``."""
    match = closest(name, candidates)
    return f" (did you mean '{match}'?)" if match else ""

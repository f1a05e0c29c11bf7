"""Byte sizes: the binary units, the one parser of sizes people write (``24GiB``, ``5GB``, bytes) and the one way
sizes are printed. No imports from mtune but :mod:`mtune.errors`, so any layer may use it."""

from __future__ import annotations

import re

from mtune.errors import MtuneError

__all__ = ["GIB", "MIB", "SizeError", "parse_bytes", "parse_budget", "format_bytes"]

MIB = 1024**2
GIB = 1024**3

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": MIB, "gib": GIB, "tib": 1024**4}
_SIZE = re.compile(r"\s*(\d*\.?\d+)\s*([a-zA-Z]*)\s*")


class SizeError(MtuneError, ValueError):
    """A size that is not a number of bytes nor a number with a unit; the message names the key or flag."""


def parse_bytes(text: int | float | str, what: str = "memory", *,
                message: str = "{what}={text!r}: write a size such as 24GiB, 80GB or 512MiB") -> int:
    """Bytes from an int (returned as it is) or a string: a number, maybe with a fraction (``1.5TB``, ``.5GiB``),
    then a unit in any case or none (bytes).

    Units with ``i`` are binary (``KiB``, ``MiB``, ``GiB``, ``TiB``: powers of 1024); the others are decimal
    (``KB``/``K``, ``MB``/``M``, ``GB``/``G``, ``TB``/``T``: powers of 1000), as Hugging Face reads
    ``max_shard_size``: ``"80GB"`` is 80 * 10**9 bytes, ``"80GiB"`` is 80 * 2**30. A fraction of a byte is dropped.

    ``what`` names the key or flag in the error; ``message`` is the error's template (``{what}``, ``{text!r}``), so
    each caller keeps its own wording (``max_shard_size`` says "is not a size").
    """
    if isinstance(text, int):
        return text
    match = _SIZE.fullmatch(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise SizeError(message.format(what=what, text=text))
    return int(float(match.group(1)) * _UNITS[unit])


def parse_budget(text: int | float | str, what: str) -> int:
    """A memory budget in bytes (``--device-memory``, ``--host-memory``, ``device_memory_limit``): as
    :func:`parse_bytes`, but a string must carry its unit and the budget must be at least 1 MiB. ``24`` for a
    24 GiB card is the mistake both catch: a bare number is bytes, and no run fits in 24 of them. An int (YAML's
    ``device_memory_limit: 25769803776``) is bytes, as before."""
    match = _SIZE.fullmatch(text) if isinstance(text, str) else None
    if match is not None and match.group(2) == "":
        raise SizeError(f"{what}={text!r} has no unit: write {match.group(1)}GiB, {match.group(1)}GB or "
                        f"{match.group(1)}MiB (a bare number would be bytes)")
    size = parse_bytes(text, what)
    if size < MIB:
        raise SizeError(f"{what}={text!r} is {size} bytes, less than any run needs: write a size such as 24GiB "
                        "(an int is bytes)")
    return size


def format_bytes(n: int | float) -> str:
    """``1.50 GiB`` from a GiB up, else ``512.0 MiB`` (negative sizes alike)."""
    if abs(n) >= GIB:
        return f"{n / GIB:.2f} GiB"
    return f"{n / MIB:.1f} MiB"

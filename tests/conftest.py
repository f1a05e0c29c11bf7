"""Test-session settings shared by every test."""

import logging
import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _peak_flops_cache(tmp_path_factory):
    """Runs measure the CPU's matmul peak once and cache it: keep that cache in this session's temp dir (shared by
    its tests and the processes they start), never in the user's ~/.cache."""
    before = os.environ.get("MTUNE_PEAK_FLOPS_CACHE")
    os.environ["MTUNE_PEAK_FLOPS_CACHE"] = str(tmp_path_factory.mktemp("peak-flops") / "peak_flops.json")
    yield
    if before is None:
        os.environ.pop("MTUNE_PEAK_FLOPS_CACHE", None)
    else:
        os.environ["MTUNE_PEAK_FLOPS_CACHE"] = before


_MTUNE_LOGGER = logging.getLogger("mtune")
_LOGGER_AT_START = (list(_MTUNE_LOGGER.handlers), _MTUNE_LOGGER.propagate, _MTUNE_LOGGER.level)
"""The ``mtune`` logger as the session found it: taken at import, before any fixture (a module-scoped fixture that
runs a recipe configures the logger before a test's own fixtures could take its state)."""


@pytest.fixture(autouse=True)
def _mtune_logger_as_found():
    """A recipe run in process configures the ``mtune`` logger for a terminal (its own stderr handler, no
    propagation), which would hide later tests' log records from ``caplog``: put it back as the session found it,
    before and after every test."""
    handlers, propagate, level = _LOGGER_AT_START
    _MTUNE_LOGGER.handlers[:] = handlers
    _MTUNE_LOGGER.propagate, _MTUNE_LOGGER.level = propagate, level
    yield
    _MTUNE_LOGGER.handlers[:] = handlers
    _MTUNE_LOGGER.propagate, _MTUNE_LOGGER.level = propagate, level


# The directories whose modules run whole fine-tunes (subprocesses, several ranks), heaviest first. scripts/test.sh
# hands each worker one module at a time (--dist loadscope: a module's fixtures are built once, on one worker) in
# the order below, so that the suite does not end on one worker running a long module while the other idles: the
# README's first command (over a minute) would otherwise be collected last.
_HEAVY_FIRST = ("tests/test_readme.py", "tests/recipes/", "tests/mtune/models/", "tests/benchmarks/")


def pytest_collection_modifyitems(items):
    def rank(item):
        path = item.nodeid.split("::")[0]
        return next((i for i, prefix in enumerate(_HEAVY_FIRST) if path.startswith(prefix)), len(_HEAVY_FIRST))

    items.sort(key=rank)  # stable: each module's tests keep their order, and modules their collection order

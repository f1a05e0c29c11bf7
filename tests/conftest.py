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


@pytest.fixture(autouse=True)
def _mtune_logger_as_found():
    """A recipe run in process configures the ``mtune`` logger for a terminal (its own stderr handler, no
    propagation), which would hide later tests' log records from ``caplog``: put it back after every test."""
    logger = logging.getLogger("mtune")
    handlers, propagate, level = list(logger.handlers), logger.propagate, logger.level
    yield
    logger.handlers[:] = handlers
    logger.propagate, logger.level = propagate, level

"""Test-session settings shared by every test."""

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

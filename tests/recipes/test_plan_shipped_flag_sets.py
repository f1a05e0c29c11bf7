"""Every flag set of the shipped training configs, planned on its family's tiny model, gives the bytes recorded in
``tests/assets/plans/shipped_flag_sets.json``: a change to how techniques are declared, applied or planned that
moves any planned figure fails here. The figures were recorded by the planner before the memory techniques moved
into their own modules; regenerate them (``MTUNE_RECORD_PLANS=1 pytest tests/recipes/test_plan_shipped_flag_sets.py``)
only for a change meant to move a plan, and say why in the commit."""

import json
import os

import pytest

from mtune.training.planning.plan import plan_memory
from tests._helpers.paths import REPO
from tests._helpers.shipped import FLAG_SETS, shipped_on_tiny

GOLDEN = REPO / "tests" / "assets" / "plans" / "shipped_flag_sets.json"


def _plan(config: str) -> dict:
    _, _, cfg = shipped_on_tiny(config)
    world_size = 2 if "distributed" in str(cfg.recipe) else 1
    plan = plan_memory(cfg, world_size=world_size)
    return {"device_peak_bytes": plan.device_peak_bytes, "host_peak_bytes": plan.host_peak_bytes,
            "device": plan.device, "host": plan.host}


@pytest.fixture(scope="module")
def golden():
    if os.environ.get("MTUNE_RECORD_PLANS"):
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps({c: _plan(c) for c in FLAG_SETS}, indent=1, sort_keys=True) + "\n")
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("config", FLAG_SETS)
def test_shipped_flag_set_plans_as_recorded(config, golden):
    assert config in golden, f"{config} has no recorded plan: record it (see the module docstring)"
    assert _plan(config) == golden[config]

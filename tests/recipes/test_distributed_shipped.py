"""The shipped distributed configs run as shipped on 2 CPU processes, with what the single-device tests cannot
reach: the task evaluation before training (generation through the sharded model, then training through the same
all-gather buffers) and the memory breakdown of sharded parameters (DTensors, NF4 shards among them)."""

import json
import math
import os
import subprocess
import sys

import pytest
from safetensors import safe_open

from tests._helpers.recipes import REPO

pytestmark = pytest.mark.slow

TINY_MODEL = REPO / "mtune" / "assets" / "tiny" / "model" / "model.safetensors"


def _weights() -> int:
    """Elements of the shipped tiny model's weights."""
    with safe_open(TINY_MODEL, "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


@pytest.mark.parametrize("config", ["tiny/full_distributed", "tiny/qlora_distributed"])
def test_shipped_distributed_config_runs_with_task_eval_and_memory_breakdown(tmp_path, config):
    recipe = "full_distributed" if "full" in config else "lora_distributed"
    env = {**os.environ, "PYTHONPATH": str(REPO), "MTUNE_QUIET": "1"}
    # Only the output directory, the length and the evaluation's size change; every other key is as shipped.
    overrides = [f"output_dir={tmp_path}", "epochs=1", "max_steps_per_epoch=2", "task_eval.max_samples=2",
                 "memory_breakdown=true"]
    out = subprocess.run([sys.executable, "-m", "mtune", "run", "--nproc_per_node", "2", recipe, "--config", config,
                          *overrides], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["task_eval_before"]["num_samples"] == results["task_eval_after"]["num_samples"] == 2
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 2  # trained after generating through the sharded model
    peak = json.loads((tmp_path / "memory_breakdown.json").read_text())["device"]  # each category's peak
    n = _weights()
    if recipe == "full_distributed":
        # fp32 (the shipped dtype for full) parameters, each rank holding half of every weight.
        assert peak["parameters"] == pytest.approx(n * 4 / 2, rel=0.01)
        assert peak["gradients"] == peak["parameters"] and peak["optimizer_state"] >= 2 * peak["parameters"]
    else:
        # NF4 bases (~0.5 byte per weight plus scales) and bf16 norms / embeddings, halved: well under bf16's half.
        assert 0 < peak["parameters"] < n * 2 / 2 * 0.8
    assert peak["activations"] > 0

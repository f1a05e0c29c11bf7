"""Recipe runs on a tiny model: a Hugging Face model directory with a Llama 3 tokenizer, a small instruction
dataset, and a config built from ``tests/assets/configs/tiny_train.yaml`` with overrides."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

from tests._helpers.models import write_tiny_hf_model
from tests._helpers.paths import REPO
from tests._helpers.tokenizers import write_tokenizer_files

TRAIN_CONFIG = REPO / "tests" / "assets" / "configs" / "tiny_train.yaml"

_WORDS = "red green blue cat dog sun moon tree rock bird fish star".split()


def write_tiny_checkpoint(tmp_dir, family: str = "llama3_1", **overrides) -> Path:
    """A tiny random ``family`` model (untied by default, so lm_head can be adapted) with a Llama 3 tokenizer."""
    vocab = write_tokenizer_files(Path(tmp_dir) / "tok", "llama3")
    path = write_tiny_hf_model(tmp_dir, family, vocab_size=vocab, bos_token_id=vocab - 256,
                               eos_token_id=vocab - 255, **overrides)
    write_tokenizer_files(path, "llama3")
    return path


def write_instruct_data(path, n: int = 48, seed: int = 0) -> Path:
    """``n`` instruction rows (reverse a few words), JSONL."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = rng.sample(_WORDS, rng.randint(2, 4))
        rows.append({"instruction": "reverse: " + " ".join(words), "input": "", "output": " ".join(words[::-1])})
    path = Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def train_overrides(tmp_path, checkpoint: Path, data: Path, **changes) -> list[str]:
    """Command-line overrides that point ``tiny_train.yaml`` at the test's model, data and output dir."""
    base = {"output_dir": str(tmp_path / "out"), "model.checkpoint_dir": str(checkpoint), "dataset.source": str(data)}
    base.update({k: v for k, v in changes.items()})
    return [f"{k}={_yaml(v)}" for k, v in base.items()]


def _yaml(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_yaml(v) for v in value) + "]"
    return str(value)


def run_recipe_in_process(recipe: str, overrides: list[str], config: Path = TRAIN_CONFIG) -> Path:
    """Run a built-in recipe in this process exactly as ``mtune run`` would; returns the output dir."""
    from mtune._cli.catalog import find_recipe
    from mtune._cli.run import run_recipe

    run_recipe(find_recipe(recipe), config, overrides)
    out = next(o.split("=", 1)[1] for o in overrides if o.startswith("output_dir="))
    return Path(out)


def plan_and_run(recipe: str, overrides: list[str], config: Path = TRAIN_CONFIG):
    """``mtune plan`` of ``config`` with ``overrides``, then the same run through the recipe in this process:
    ``(plan, output dir, the run's memory_breakdown.json)`` (``overrides`` set ``memory_breakdown``)."""
    from mtune._cli.catalog import find_recipe, load_recipe_module
    from mtune._cli.run import load_and_check
    from mtune.training.planning.plan import plan_memory

    plan = plan_memory(load_and_check(load_recipe_module(find_recipe(recipe)), config, overrides))
    out = run_recipe_in_process(recipe, overrides, config)
    return plan, out, json.loads((out / "memory_breakdown.json").read_text())


def read_metrics(output_dir) -> list[dict]:
    lines = (Path(output_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def losses(output_dir) -> list[float]:
    return [row["loss"] for row in read_metrics(output_dir) if "loss" in row]


def mtune_run(recipe: str, overrides: list[str]) -> subprocess.CompletedProcess:
    """``mtune run RECIPE --config tiny_train.yaml overrides`` in a subprocess, quiet; asserts it succeeded."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "MTUNE_QUIET": "1"}
    out = subprocess.run([sys.executable, "-m", "mtune", "run", recipe, "--config", str(TRAIN_CONFIG), *overrides],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def torchrun(recipe: str, overrides: list[str], nproc: int = 2, check: bool = True) -> subprocess.CompletedProcess:
    """``mtune run --nproc_per_node NPROC RECIPE --config tiny_train.yaml overrides`` (torchrun on CPU ranks), quiet;
    asserts it succeeded (unless ``check`` is false). Returns the finished process (its stderr)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "MTUNE_QUIET": "1"}
    out = subprocess.run([sys.executable, "-m", "mtune", "run", "--nproc_per_node", str(nproc), recipe, "--config",
                          str(TRAIN_CONFIG), *overrides], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0 or not check, out.stderr[-4000:]
    return out


def count_planned(monkeypatch, module, name: str) -> list[int]:
    """Wrap the planner shortcut ``module.name`` (it returns what a loop runs: tiles, chunks) so each call's length is
    recorded in the returned list, for tests that then compare with the whole loop."""
    planned, ran = getattr(module, name), []
    monkeypatch.setattr(module, name, lambda *args: ran.append(len(planned(*args))) or planned(*args))
    return ran

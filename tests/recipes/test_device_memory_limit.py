"""device_memory_limit on the CPU, through the real recipe: a limit the run can meet is met on every step (and CUDA
is never touched); under one it cannot meet, oom_recovery re-plans (the same samples and losses) or, where nothing
fits, ends the run with one line and a checkpoint; a misspelt key is caught by validation."""

import os
import re
import subprocess
import sys

import pytest
import torch

from mtune.config import load_config, validate_config
from tests._helpers.paths import REPO
from tests._helpers.recipes import TRAIN_CONFIG, read_metrics, run_recipe_in_process, train_overrides

GIB = 2**30


def test_a_limit_the_run_can_meet_holds_on_every_step(tmp_path, tiny_checkpoint, tiny_data, monkeypatch):
    def no_cuda(*args, **kwargs):
        raise AssertionError("a CPU run touched CUDA")

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", no_cuda)
    out = run_recipe_in_process("lora_single_device", train_overrides(
        tmp_path, tiny_checkpoint, tiny_data, device_memory_limit="32MiB", max_steps_per_epoch=3))
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    peaks = [r["peak_tensor_gib"] * GIB for r in rows]  # tracked on every step, without plan_check
    assert all(0 < peak <= 32 * 2**20 for peak in peaks), peaks


@pytest.fixture(scope="module")
def free_run(tmp_path_factory, tiny_checkpoint, tiny_data):
    """The unconstrained 4-step run, its device bytes tracked: what the constrained runs are compared with."""
    out = run_recipe_in_process("lora_single_device", train_overrides(
        tmp_path_factory.mktemp("free"), tiny_checkpoint, tiny_data, max_steps_per_epoch=4, memory_breakdown=True))
    return read_metrics(out)


def test_a_limit_nothing_fits_ends_in_one_line_with_an_intact_checkpoint(tmp_path, tiny_checkpoint, tiny_data,
                                                                        free_run):
    """4 MiB is below the tiny model's weights (6.4 MiB of fp32): no config fits. The run ends with exit status 1,
    one error line (no traceback) saying what would fit, a size between the limit and the unconstrained peak, and a
    checkpoint of its last whole step (0) from which a run without the limit trains the unconstrained run's losses.
    Mutation seen failing: _give_up not saving (no step_0)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "MTUNE_QUIET": "1"}
    done = subprocess.run([sys.executable, "-m", "mtune", "run", "lora_single_device", "--config", str(TRAIN_CONFIG),
                           *train_overrides(tmp_path, tiny_checkpoint, tiny_data, device_memory_limit="4MiB")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert errors[0].startswith("error: out of memory in step 1 (device_memory_limit: the run's tensors on the device "
                                "reached "), errors[0]
    assert "oom_recovery cannot go on: nothing that keeps the samples per step fits; the leanest config" in errors[0]
    would_fit = re.search(r"a device_memory_limit of about ([0-9.]+) MiB would fit it", errors[0])
    assert would_fit and 4 < float(would_fit.group(1)) < max(r["peak_tensor_gib"] for r in free_run) * 1024
    checkpoint = tmp_path / "out" / "step_0"
    assert errors[0].endswith(f"saved the last whole step, 0, to {checkpoint} (resume_from_checkpoint=true)")
    resumed = run_recipe_in_process("lora_single_device", train_overrides(
        tmp_path / "resumed", tiny_checkpoint, tiny_data, max_steps_per_epoch=2, resume_from_checkpoint=checkpoint))
    assert [r["loss"] for r in read_metrics(resumed)] == pytest.approx([r["loss"] for r in free_run[:2]], abs=1e-5)


def test_validate_catches_a_misspelt_limit():
    from mtune._cli.catalog import find_recipe, load_recipe_module

    schema = load_recipe_module(find_recipe("lora_single_device")).SCHEMA
    cfg = load_config(TRAIN_CONFIG, ["output_dir=/x", "device_memory_limt=20GiB"])
    assert any("device_memory_limt" in e and "device_memory_limit" in e for e in validate_config(cfg, schema).errors)
    cfg = load_config(TRAIN_CONFIG, ["output_dir=/x", "device_memory_limit=20GB!"])
    assert validate_config(cfg, schema).errors == [
        "device_memory_limit='20GB!': write a size such as 24GiB, 80GB or 512MiB (null: the whole device)"]


def test_oom_recovery_replans_under_75_percent_and_a_resume_runs_the_recovered_config(
        tmp_path, tiny_checkpoint, tiny_data, free_run, capsys):
    """Issue 35's done-when on one device: under 75% of the device bytes the unconstrained run peaks at, every step
    trains the same samples (each step's trained tokens are the unconstrained run's), holds its peak under the limit,
    and ends within 0.05 of the unconstrained loss (the same numbers: within 1e-5); the re-plan is logged and written
    to mtune_fit.yaml, whose config a resume from the step-2 checkpoint runs without another re-plan, with the same
    losses. Mutations seen failing: the recovered config not written into later checkpoints (the resume is refused:
    batch_size 4 -> 2); the chosen micro-batch size never applied (split a no-op: the step runs out again until the
    bound of 3 re-plans ends the run)."""
    free_rows = free_run
    limit = int(0.75 * max(r["peak_tensor_gib"] for r in free_rows) * GIB)
    capsys.readouterr()
    held = run_recipe_in_process("lora_single_device", train_overrides(
        tmp_path / "held", tiny_checkpoint, tiny_data, max_steps_per_epoch=4, device_memory_limit=limit,
        save_every_n_steps=2))
    lines = [line for line in capsys.readouterr().err.splitlines() if "oom_recovery:" in line]
    assert lines and lines[0].startswith("mtune: oom_recovery: step 1 ran out of memory (device_memory_limit: "), lines
    assert all("with the same 4 samples per step in the same order" in line for line in lines), lines
    rows = read_metrics(held)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["trained_tokens"] for r in rows] == [r["trained_tokens"] for r in free_rows]
    assert all(0 < r["peak_tensor_gib"] * GIB <= limit for r in rows), ([r["peak_tensor_gib"] * GIB for r in rows],
                                                                         limit)
    assert abs(rows[-1]["loss"] - free_rows[-1]["loss"]) < 0.05
    assert all(abs(a["loss"] - b["loss"]) < 1e-5 for a, b in zip(rows, free_rows)), (rows, free_rows)
    written = load_config(held / "mtune_fit.yaml")
    assert written.batch_size * written.gradient_accumulation_steps == 4
    assert (written.batch_size, written.enable_activation_checkpointing) != (4, False)  # something changed

    capsys.readouterr()
    resumed = run_recipe_in_process("lora_single_device", [
        f"output_dir={tmp_path / 'resumed'}", f"resume_from_checkpoint={held / 'step_2'}"], config=held / "mtune_fit.yaml")
    assert "oom_recovery:" not in capsys.readouterr().err  # the recovered config fits from the start
    again = read_metrics(resumed)
    assert [r["step"] for r in again] == [3, 4]
    assert all(abs(a["loss"] - b["loss"]) < 1e-5 for a, b in zip(again, rows[2:])), (again, rows[2:])


def test_without_oom_recovery_the_limit_ends_the_run(tmp_path, tiny_checkpoint, tiny_data):
    from mtune.training.memory.oom import OutOfMemory

    with pytest.raises(OutOfMemory, match="^out of memory during forward/backward and optimizer step"):
        run_recipe_in_process("lora_single_device", train_overrides(
            tmp_path, tiny_checkpoint, tiny_data, max_steps_per_epoch=3, device_memory_limit="10MiB",
            oom_recovery=False))

"""device_memory_limit on the CPU, through the real recipe: a limit the run can meet is met on every step (and CUDA
is never touched); one it cannot meet ends the run with the one-line out-of-memory advice; a misspelt key is caught
by validation."""

import os
import subprocess
import sys

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


def test_a_limit_the_run_cannot_meet_ends_in_the_out_of_memory_line(tmp_path, tiny_checkpoint, tiny_data):
    env = {**os.environ, "PYTHONPATH": str(REPO), "MTUNE_QUIET": "1"}
    done = subprocess.run([sys.executable, "-m", "mtune", "run", "lora_single_device", "--config", str(TRAIN_CONFIG),
                           *train_overrides(tmp_path, tiny_checkpoint, tiny_data, device_memory_limit="1MiB")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert errors[0].startswith("error: out of memory during forward/backward and optimizer step (device_memory_limit: "
                                "the run's tensors on the device reached ")
    assert "over the limit of 1.0 MiB); to lower the peak try: " in errors[0]
    assert "--device-memory 1MiB lora_single_device" in errors[0]


def test_validate_catches_a_misspelt_limit():
    from mtune._cli.catalog import find_recipe, load_recipe_module

    schema = load_recipe_module(find_recipe("lora_single_device")).SCHEMA
    cfg = load_config(TRAIN_CONFIG, ["output_dir=/x", "device_memory_limt=20GiB"])
    assert any("device_memory_limt" in e and "device_memory_limit" in e for e in validate_config(cfg, schema).errors)
    cfg = load_config(TRAIN_CONFIG, ["output_dir=/x", "device_memory_limit=20GB!"])
    assert validate_config(cfg, schema).errors == [
        "device_memory_limit='20GB!': write a size such as 24GiB, 80GB or 512MiB"]


def test_oom_recovery_runs_the_step_again_in_smaller_micro_batches(tmp_path, tiny_checkpoint, tiny_data, capsys):
    """A batch of 4 peaks at 11.8-12.6 MiB of live tensors on this model, of 2 at 8.9-9.0 MiB (memory_breakdown): under
    10 MiB the first step runs out, runs again as 2 micro-batches of 2 rows, and the run ends every step with the
    same samples per step and the unconstrained run's losses."""
    free = run_recipe_in_process("lora_single_device", train_overrides(
        tmp_path / "free", tiny_checkpoint, tiny_data, max_steps_per_epoch=3))
    capsys.readouterr()
    held = run_recipe_in_process("lora_single_device", train_overrides(
        tmp_path / "held", tiny_checkpoint, tiny_data, max_steps_per_epoch=3, device_memory_limit="10MiB"))
    lines = [line for line in capsys.readouterr().err.splitlines() if "oom_recovery:" in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith("mtune: oom_recovery: step 1 ran out of memory (device_memory_limit: ")
    assert lines[0].endswith("in 2 micro-batches of 2 rows: the same 4 samples per step, in the same order")
    rows, free_rows = read_metrics(held), read_metrics(free)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["trained_tokens"] for r in rows] == [r["trained_tokens"] for r in free_rows]
    assert all(abs(a["loss"] - b["loss"]) < 1e-5 for a, b in zip(rows, free_rows)), (rows, free_rows)
    assert all(r["peak_tensor_gib"] * GIB <= 10 * 2**20 for r in rows)  # the failed attempt's peak is not logged


def test_without_oom_recovery_the_limit_ends_the_run(tmp_path, tiny_checkpoint, tiny_data):
    import pytest

    from mtune.training.memory.oom import OutOfMemory

    with pytest.raises(OutOfMemory, match="^out of memory during forward/backward and optimizer step"):
        run_recipe_in_process("lora_single_device", train_overrides(
            tmp_path, tiny_checkpoint, tiny_data, max_steps_per_epoch=3, device_memory_limit="10MiB",
            oom_recovery=False))

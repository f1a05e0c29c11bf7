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

"""A run never destroys results it did not make: an output_dir holding a run is refused unless resuming or
overwrite_output_dir=true."""

import pytest

from mtune.errors import OutputExistsError
from mtune.training.context import claim_output_dir


def _earlier_run(root):
    (root / "step_2").mkdir(parents=True)
    (root / "step_2" / "model.safetensors").write_bytes(b"weights")
    (root / "step_2" / "mtune_state.json").write_text('{"step": 2, "complete": true}')
    (root / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (root / "notes.txt").write_text("mine")  # not a run output: never touched
    return {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_an_output_dir_holding_a_run_is_refused_and_left_byte_identical(tmp_path):
    before = _earlier_run(tmp_path)
    with pytest.raises(OutputExistsError) as info:
        claim_output_dir(tmp_path, resuming=False, overwrite=False, is_main=True)
    assert str(info.value) == f"output_dir={tmp_path} already holds a run (metrics.jsonl, step_2)"
    assert "resume_from_checkpoint=true" in info.value.hint and "overwrite_output_dir=true" in info.value.hint
    assert {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_resuming_keeps_the_run_and_overwriting_deletes_only_its_outputs(tmp_path):
    before = _earlier_run(tmp_path)
    claim_output_dir(tmp_path, resuming=True, overwrite=False, is_main=True)
    assert {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    claim_output_dir(tmp_path, resuming=False, overwrite=True, is_main=False)  # only the main process deletes
    assert (tmp_path / "step_2").is_dir()
    claim_output_dir(tmp_path, resuming=False, overwrite=True, is_main=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    claim_output_dir(tmp_path / "new", resuming=False, overwrite=False, is_main=True)  # absent or empty: fine


def test_a_run_that_logged_nothing_leaves_nothing_to_refuse(tmp_path):
    """A run that failed in its first step (a loss that does not fit the recipe) left an empty metrics.jsonl; the
    same command, mended, was refused as if a run were there."""
    (tmp_path / "metrics.jsonl").write_text("")
    claim_output_dir(tmp_path, resuming=False, overwrite=False, is_main=True)
    assert (tmp_path / "metrics.jsonl").exists()  # kept: the next run appends to it
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    with pytest.raises(OutputExistsError, match=r"already holds a run \(metrics.jsonl\)$"):
        claim_output_dir(tmp_path, resuming=False, overwrite=False, is_main=True)


def test_an_output_dir_that_is_a_file_is_named_as_one(tmp_path):
    """It said "cannot create it (File exists)"."""
    from mtune.config.errors import ConfigError
    from mtune.training.context import _lock_output_dir

    (tmp_path / "out").write_text("notes")
    with pytest.raises(ConfigError, match=r"^output_dir=.*out is a file, not a directory: name a directory"):
        _lock_output_dir(tmp_path / "out", force=False, rank=0)
    assert (tmp_path / "out").read_text() == "notes"


def test_half_written_and_final_checkpoints_count_as_a_run(tmp_path):
    """A crash mid-save leaves only a temp checkpoint dir; a finished run may hold only final/: both are refused."""
    import re

    from mtune.training.checkpointing.atomic import TMP_PREFIX
    from mtune.training.checkpointing.checkpoint_dir import FINAL_NAME

    for name in (f"{TMP_PREFIX}step_3", FINAL_NAME):
        root = tmp_path / name.strip(".")
        (root / name).mkdir(parents=True)
        with pytest.raises(OutputExistsError, match=rf"already holds a run \({re.escape(name)}\)$"):
            claim_output_dir(root, resuming=False, overwrite=False, is_main=True)


def _cfg(tmp_path, **changes):
    from omegaconf import OmegaConf

    return OmegaConf.create({"device": "cpu", "dtype": "fp16", "seed": 7, "output_dir": str(tmp_path / "out"),
                             "resume_from_checkpoint": False, "overwrite_output_dir": False, **changes})


def test_setup_run_on_cpu_seeds_and_derives_the_fp16_settings(tmp_path):
    """setup_run: every RNG seeded with ``seed``, fp16 stored as fp32 with loss scaling on and fp16 autocast."""
    import logging
    import random

    import torch

    from mtune.training.context import setup_run
    from mtune.training.output_lock import release_output_locks

    torch.manual_seed(7)
    random.seed(7)
    expected = (torch.rand(3), random.random())
    torch.manual_seed(0)
    random.seed(0)
    try:
        run = setup_run(_cfg(tmp_path), rank=1, world_size=2)
        assert (torch.rand(3).tolist(), random.random()) == (expected[0].tolist(), expected[1])
        assert run.device == torch.device("cpu") and run.dtype == torch.float32 and run.dtype_name == "fp16"
        assert (run.rank, run.world_size, run.seed, run.output_dir) == (1, 2, 7, tmp_path / "out")
        scaler = run.loss_scaler()
        assert scaler.enabled and scaler.get_scale() == 2.0**16
        with run.autocast():
            assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float16
        assert logging.getLogger("mtune").level == logging.WARNING  # ranks other than 0 log warnings only
    finally:
        release_output_locks()  # as `mtune run` does when its recipe ends


def test_setup_run_refuses_a_dtype_or_device_the_machine_cannot_do(tmp_path):
    """An unknown dtype, or device=cuda without CUDA, is one ConfigError before anything is written."""
    import torch

    from mtune.config.errors import ConfigError
    from mtune.training.context import setup_run

    with pytest.raises(ConfigError, match="dtype='float8' is not supported"):
        setup_run(_cfg(tmp_path, dtype="float8"))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="device=cuda: this machine has no CUDA GPU"):
            setup_run(_cfg(tmp_path, device="cuda"))
    assert not (tmp_path / "out").exists()

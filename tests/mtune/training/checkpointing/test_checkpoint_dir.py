import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import mtune
from mtune.training.checkpointing.checkpoint_dir import (
    FAULT_POINTS,
    CheckpointWriter,
    find_latest_checkpoint,
    list_checkpoints,
    read_checkpoint_state,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
CONFIG = {"model": {"size": "tiny"}, "batch_size": 2, "output_dir": "/x"}

def _write_step(out, step: int) -> None:
    """Writes step_<step> with keep_last_n_checkpoints=1; the "model" is two files written by the caller."""
    writer = CheckpointWriter(out, keep_last_n_checkpoints=1)
    with writer.open(step=step, epoch=0, config={"step": step}, kind="hf_full") as tmp:
        (tmp / "model.safetensors").write_bytes(b"w" * 1000)
        (tmp / "config.json").write_text("{}")


def _write_and_die(out, step: int, fault: str) -> subprocess.CompletedProcess:
    """:func:`_write_step` in a process of its own, killed at the fault point ``fault``."""
    script = ("import sys; from tests.mtune.training.checkpointing.test_checkpoint_dir import _write_step; "
              "_write_step(sys.argv[1], int(sys.argv[2])); print('done')")
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), MTUNE_FAULT_INJECT=fault)
    return subprocess.run([sys.executable, "-c", script, str(out), str(step)], env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("fault", FAULT_POINTS)
def test_crash_at_each_point_never_yields_a_half_checkpoint(tmp_path, fault, caplog, monkeypatch):
    monkeypatch.delenv("MTUNE_FAULT_INJECT", raising=False)  # the good steps, written here, must not die
    _write_step(tmp_path, 1)
    proc = _write_and_die(tmp_path, 2, fault)
    assert proc.returncode == 137 and "done" not in proc.stdout
    new_is_complete = fault in ("after_rename", "during_prune")
    leftovers = sorted(p.name for p in tmp_path.iterdir())
    if new_is_complete:
        assert leftovers == ["step_1", "step_2"]  # pruning had not finished
    else:
        assert leftovers[1] == "step_1" and re.fullmatch(r"\.tmp_step_2_\d+", leftovers[0])
    caplog.set_level("WARNING")
    latest = find_latest_checkpoint(tmp_path)
    assert latest == tmp_path / ("step_2" if new_is_complete else "step_1")
    assert read_checkpoint_state(latest)["config"] == {"step": 2 if new_is_complete else 1}
    # stale pieces are cleaned with a log line; a complete step_1 survives until the next prune
    remaining = sorted(p.name for p in tmp_path.iterdir())
    if fault == "during_prune":
        assert remaining == ["step_2"] and "interrupted run" in caplog.text
    elif fault == "after_rename":
        assert remaining == ["step_1", "step_2"]
    else:
        assert remaining == ["step_1"] and "interrupted run" in caplog.text
    # the next save works and prunes to one
    _write_step(tmp_path, 3)
    assert [p.name for _, p in list_checkpoints(tmp_path)] == ["step_3"]


def test_state_file_contents_and_keep_last_n(tmp_path):
    writer = CheckpointWriter(tmp_path, keep_last_n_checkpoints=2)
    for step in (10, 20, 30, 40):
        path = writer.save(step=step, epoch=step // 20, config=CONFIG, kind="peft_adapter",
                           write_fn=lambda d: (d / "adapter_model.safetensors").write_bytes(b"a"))
        assert path == tmp_path / f"step_{step}"
    assert [s for s, _ in list_checkpoints(tmp_path)] == [30, 40]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_30", "step_40"]
    state = json.loads((tmp_path / "step_40" / "mtune_state.json").read_text())
    assert {k: state[k] for k in ("mtune_version", "step", "epoch", "kind", "final", "complete", "config",
                                  "files")} == {
        "mtune_version": mtune.__version__, "step": 40, "epoch": 2, "kind": "peft_adapter", "final": False,
        "complete": True, "config": CONFIG, "files": ["adapter_model.safetensors", "checksums/rank_0.json"]}
    # final is never pruned and wins only with a higher step
    writer.save(step=40, epoch=2, config=CONFIG, kind="peft_adapter", write_fn=lambda d: None, final=True)
    assert find_latest_checkpoint(tmp_path) == tmp_path / "step_40"
    writer.save(step=45, epoch=2, config=CONFIG, kind="peft_adapter", write_fn=lambda d: None, final=True)
    writer.save(step=50, epoch=2, config=CONFIG, kind="peft_adapter", write_fn=lambda d: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "step_40", "step_50"]
    assert read_checkpoint_state(tmp_path / "final")["step"] == 45


def test_rewriting_a_step_replaces_it_and_errors_discard_the_temp_dir(tmp_path):
    writer = CheckpointWriter(tmp_path)
    writer.save(step=5, epoch=0, config={}, kind="hf_full", write_fn=lambda d: (d / "a").write_text("old"))
    writer.save(step=5, epoch=0, config={}, kind="hf_full", write_fn=lambda d: (d / "b").write_text("new"))
    assert sorted(p.name for p in (tmp_path / "step_5").iterdir()) == ["b", "checksums", "mtune_state.json"]
    with pytest.raises(RuntimeError, match="disk full"):
        with writer.open(step=6, epoch=0, config={}, kind="hf_full"):
            raise RuntimeError("disk full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_5"]


def test_dirs_without_state_file_are_not_checkpoints(tmp_path):
    (tmp_path / "step_9").mkdir()
    (tmp_path / "step_9" / "model.safetensors").write_bytes(b"x")
    assert find_latest_checkpoint(tmp_path / "missing") is None
    assert find_latest_checkpoint(tmp_path, clean=False) is None
    with pytest.raises(FileNotFoundError, match="step_9 is not a complete mtune checkpoint"):
        read_checkpoint_state(tmp_path / "step_9")
    # a resume_from_checkpoint path that does not exist (a typo): said so, not "not a complete checkpoint"
    with pytest.raises(FileNotFoundError, match=r"step_8: no such checkpoint directory$"):
        read_checkpoint_state(tmp_path / "step_8")


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


class _FullDisk:
    """A file that takes ``room`` bytes, then fails as a full disk does (``OSError`` ENOSPC)."""

    def __init__(self, path, room):
        self.f, self.room = open(path, "wb"), room

    def write(self, data):
        import errno

        if self.f.tell() + len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.f.write(data)

    def flush(self):
        self.f.flush()


@pytest.mark.parametrize("failure", ["oserror", "safetensors", "torch_save"])
def test_a_full_disk_at_save_keeps_the_previous_checkpoint_and_says_what_to_free(tmp_path, failure):
    import errno

    import safetensors
    import torch

    from mtune.training.checkpointing.hf import CheckpointError

    writer = CheckpointWriter(tmp_path, keep_last_n_checkpoints=1)
    writer.save(step=5, epoch=0, config=CONFIG, kind="hf_full", write_fn=lambda d: (d / "w").write_bytes(b"5" * 64))
    before = _tree(tmp_path / "step_5")

    def full_disk(directory):
        (directory / "w").write_bytes(b"6" * 32)
        if failure == "oserror":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if failure == "torch_save":  # torch raises RuntimeError("... unexpected pos ...") with the OSError as context
            torch.save({"exp_avg": torch.zeros(4096)}, _FullDisk(directory / "recipe_state.pt", room=2000))
        raise safetensors.SafetensorError("Error while serializing: IoError(No space left on device)")

    with pytest.raises(CheckpointError) as info:
        writer.save(step=6, epoch=0, config=CONFIG, kind="hf_full", write_fn=full_disk)
    message = str(info.value)
    assert message.startswith(f"saving step_6 to {tmp_path}: ") and "No space left on device" in message
    assert re.search(r"\(it needs about [\d.]+ (MiB|GiB), [\d.]+ (MiB|GiB) free\)$", message)
    assert f"the previous checkpoint {tmp_path / 'step_5'} is intact" in info.value.hint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_5"]  # no half-written step_6, no .tmp_ left
    assert _tree(tmp_path / "step_5") == before


def test_a_damaged_state_file_is_reported_by_name_when_resuming(tmp_path):
    from mtune.training.checkpointing.hf import CheckpointError

    writer = CheckpointWriter(tmp_path)
    writer.save(step=3, epoch=0, config=CONFIG, kind="hf_full", write_fn=lambda d: None)
    (tmp_path / "step_3" / "mtune_state.json").write_text('{"step": 3, "comp')
    assert find_latest_checkpoint(tmp_path) is None  # listing and pruning skip it
    with pytest.raises(CheckpointError, match=r"step_3/mtune_state.json: corrupt, not JSON"):
        find_latest_checkpoint(tmp_path, strict=True)
    with pytest.raises(CheckpointError, match="not JSON"):
        read_checkpoint_state(tmp_path / "step_3")


def test_a_save_that_may_not_fit_is_announced_before_it_is_written(tmp_path, monkeypatch, caplog):
    import torch

    from mtune.training.checkpointing import disk_space

    writer = CheckpointWriter(tmp_path)
    writer.save(step=1, epoch=0, config=CONFIG, kind="hf_full", write_fn=lambda d: (d / "w").write_bytes(b"1" * 4096))
    assert writer.expected_bytes >= 4096  # the next one is about the size of the last
    monkeypatch.setattr(disk_space, "free_bytes", lambda path: 1000)
    with caplog.at_level("WARNING"):
        writer.save(step=2, epoch=0, config=CONFIG, kind="hf_full", write_fn=lambda d: None)
    assert f"{tmp_path} has 0.0 MiB free, less than the" in caplog.text and "checkpoint step_2 needs" in caplog.text
    # before the first: the model's tensors and the optimizer's (AdamW's two moments while it holds none yet)
    model = torch.nn.Linear(4, 4)
    assert disk_space.predicted_bytes(model, torch.optim.AdamW(model.parameters()), merged=False) == 3 * 20 * 4


def test_steps_are_ordered_by_number_not_by_name(tmp_path):
    """step_10 is newer than step_9 (as text it sorts first): pruning keeps it and it is the latest."""
    writer = CheckpointWriter(tmp_path, keep_last_n_checkpoints=1)
    for step in (9, 10):
        writer.save(step=step, epoch=0, config=CONFIG, kind="hf_full", write_fn=lambda d: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_10"]
    assert find_latest_checkpoint(tmp_path) == tmp_path / "step_10"


def test_the_state_records_the_world_size_and_the_callers_entries(tmp_path):
    """A resume checks the global batch with world_size and continues the run's length from its entries."""
    from mtune.config.errors import ConfigError

    writer = CheckpointWriter(tmp_path)
    path = writer.save(step=3, epoch=1, config=CONFIG, kind="hf_full", write_fn=lambda d: None, world_size=4,
                       state={"run_length": {"schedule_steps": 8, "total_steps": 12}})
    state = json.loads((path / "mtune_state.json").read_text())
    assert (state["world_size"], state["run_length"]) == (4, {"schedule_steps": 8, "total_steps": 12})
    with pytest.raises(ConfigError, match=r"keep_last_n_checkpoints must be >= 1 or null, got 0"):
        CheckpointWriter(tmp_path, keep_last_n_checkpoints=0)


def test_a_state_without_complete_true_is_not_a_checkpoint(tmp_path):
    from mtune.training.checkpointing.hf import CheckpointError

    (tmp_path / "step_3").mkdir()
    (tmp_path / "step_3" / "mtune_state.json").write_text('{"step": 3, "complete": false}')
    with pytest.raises(CheckpointError, match=r"step_3/mtune_state.json: not the state of a complete checkpoint"):
        read_checkpoint_state(tmp_path / "step_3")
    assert find_latest_checkpoint(tmp_path, clean=False) is None


def test_cleaning_spares_the_temp_dirs_of_live_writers(tmp_path):
    """A .tmp_ dir of this process or another live one may still be written; a dead writer's goes, and so does a
    step dir without its state file."""
    from mtune.training.checkpointing.checkpoint_dir import clean_incomplete_checkpoints

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    names = [f".tmp_step_5_{os.getpid()}", f".tmp_step_6_{os.getppid()}", f".tmp_step_7_{dead.pid}", "step_8"]
    for name in names:
        (tmp_path / name).mkdir()
    assert clean_incomplete_checkpoints(tmp_path) == [tmp_path / names[2], tmp_path / "step_8"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[:2])


def test_a_stale_temp_dir_of_this_process_is_emptied_before_the_save(tmp_path):
    """What an earlier write with this pid left beside the target does not end up in the checkpoint."""
    stale = tmp_path / f".tmp_step_5_{os.getpid()}"
    stale.mkdir()
    (stale / "junk").write_text("old")
    path = CheckpointWriter(tmp_path).save(step=5, epoch=0, config=CONFIG, kind="hf_full",
                                           write_fn=lambda d: (d / "w").write_text("new"))
    assert sorted(p.name for p in path.iterdir()) == ["checksums", "mtune_state.json", "w"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_5"]

"""Checkpoint checksums: computed while writing (they equal the CRC-32 of the bytes on disk), written before the
checkpoint is published, and checked on resume: a damaged file is refused in one line naming it and the newest
intact checkpoint, and resume_from_checkpoint=latest_intact resumes from that one."""

import json
import zlib

import pytest
import torch

from mtune.training.checkpointing.checkpoint_dir import CheckpointWriter
from mtune.training.checkpointing.checkpointer import Checkpointer
from mtune.training.checkpointing.manifest import (
    CHECKSUMS_DIRNAME,
    DamagedCheckpointError,
    check_before_loading,
    verify_checkpoint,
    write_safetensors,
)
from mtune.training.checkpointing.recipe_state import save_recipe_state


def _write(tmp):
    (tmp / "adapter").mkdir()
    write_safetensors({"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64)},
                      tmp / "adapter" / "adapter_model.safetensors", metadata={"format": "pt"})
    (tmp / "adapter" / "adapter_config.json").write_text('{"r": 8}\n')  # not hashed while written: hashed after
    save_recipe_state(tmp, step=1, epoch=0, optimizer=None)


def _damage(path, offset=200, data=b"\xff" * 4096):
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data[: len(raw) - offset]
    path.write_bytes(bytes(raw))


def test_checksums_are_the_crc32_of_every_file_and_are_published_with_it(tmp_path):
    writer = CheckpointWriter(tmp_path)
    path = writer.save(step=1, epoch=0, config={}, kind="lora", write_fn=_write)
    manifest = json.loads((path / CHECKSUMS_DIRNAME / "rank_0.json").read_text())
    assert manifest["algorithm"] == "crc32"
    assert sorted(manifest["files"]) == ["adapter/adapter_config.json", "adapter/adapter_model.safetensors",
                                         "recipe_state.pt"]
    for name, entry in manifest["files"].items():
        data = (path / name).read_bytes()
        assert entry == {"size": len(data), "crc32": zlib.crc32(data)}
    assert verify_checkpoint(path) == []
    _damage(path / "adapter" / "adapter_model.safetensors")
    assert verify_checkpoint(path) == [f"{path / 'adapter' / 'adapter_model.safetensors'}: checksum mismatch (its "
                                       "bytes changed since it was saved)"]
    assert verify_checkpoint(path, under=path / "model") == []  # only what is loaded is read
    with pytest.raises(DamagedCheckpointError, match="adapter_model.safetensors: checksum mismatch"):
        check_before_loading(path / "adapter")


def test_resume_refuses_a_damaged_checkpoint_naming_the_file_and_the_intact_one(tmp_path):
    checkpointer = Checkpointer(output_dir=tmp_path, config={}, base_checkpoint_dir=None, lora={})
    for step in (2, 4):
        checkpointer.writer.save(step=step, epoch=0, config={}, kind="lora", write_fn=_write)
    _damage(tmp_path / "step_4" / "adapter" / "adapter_model.safetensors")
    with pytest.raises(DamagedCheckpointError) as info:
        checkpointer.find(True)
    assert str(info.value) == (f"checkpoint {tmp_path / 'step_4'} is damaged: "
                               f"{tmp_path / 'step_4' / 'adapter' / 'adapter_model.safetensors'}: checksum mismatch "
                               "(its bytes changed since it was saved)")
    assert info.value.hint.startswith(f"resume_from_checkpoint={tmp_path / 'step_2'} (or resume_from_checkpoint="
                                      "latest_intact)")
    assert checkpointer.find("latest_intact") == tmp_path / "step_2"
    assert checkpointer.find(str(tmp_path / "step_2")) == tmp_path / "step_2"
    checkpointer.verify_checksums = False
    assert checkpointer.find(True) == tmp_path / "step_4"  # the flag skips the check


def test_checksums_deleted_after_the_save_make_the_checkpoint_damaged_not_unverified(tmp_path):
    """A checkpoint whose mtune_state.json lists checksums/rank_0.json but has none was read as one saved before
    checksums existed, and loaded unverified; now it is damaged. One of an mtune that wrote none still loads."""
    import shutil

    checkpointer = Checkpointer(output_dir=tmp_path, config={}, base_checkpoint_dir=None, lora={})
    for step in (2, 4):
        checkpointer.writer.save(step=step, epoch=0, config={}, kind="lora", write_fn=_write)
    shutil.rmtree(tmp_path / "step_4" / CHECKSUMS_DIRNAME)
    assert verify_checkpoint(tmp_path / "step_4") == [
        f"{tmp_path / 'step_4' / CHECKSUMS_DIRNAME / 'rank_0.json'}: missing (mtune_state.json lists it; the "
        "checkpoint's files cannot be verified without it)"]
    with pytest.raises(DamagedCheckpointError, match=r"step_4 is damaged: .*rank_0.json: missing"):
        checkpointer.find(True)
    assert checkpointer.find("latest_intact") == tmp_path / "step_2"
    state = json.loads((tmp_path / "step_4" / "mtune_state.json").read_text())
    state["files"] = [f for f in state["files"] if not f.startswith(CHECKSUMS_DIRNAME)]  # as an older mtune wrote
    (tmp_path / "step_4" / "mtune_state.json").write_text(json.dumps(state))
    assert verify_checkpoint(tmp_path / "step_4") == [] and checkpointer.find(True) == tmp_path / "step_4"


def test_write_safetensors_writes_the_bytes_safetensors_writes(tmp_path):
    """Oracle: safetensors.torch.save_file (keys in its order, one dtype): the same file, byte for byte (header
    length, header padded with spaces to 8 bytes, data)."""
    from safetensors.torch import save_file

    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.arange(3, dtype=torch.float32)}
    write_safetensors(tensors, tmp_path / "ours.safetensors", metadata={"format": "pt"})
    save_file(tensors, str(tmp_path / "theirs.safetensors"), metadata={"format": "pt"})
    ours = (tmp_path / "ours.safetensors").read_bytes()
    assert ours == (tmp_path / "theirs.safetensors").read_bytes() and int.from_bytes(ours[:8], "little") % 8 == 0


def test_each_rank_hashes_only_its_own_files():
    """Rank r its own distributed shards, rank 0 every other file; nobody the checksums or the state file."""
    from mtune.training.checkpointing.manifest import Manifest

    files = ["model/model.safetensors", "distributed_state/__0_0.distcp", "distributed_state/__1_0.distcp",
             "checksums/rank_0.json", "mtune_state.json"]
    assert [Manifest("/ckpt", rank=0).owns(f) for f in files] == [True, True, False, False, False]
    assert [Manifest("/ckpt", rank=1).owns(f) for f in files] == [False, False, True, False, False]


def test_a_missing_or_resized_file_is_named_and_a_file_can_be_the_scope(tmp_path):
    """Each problem its own line: a listed file gone is "missing", one of another size gives both sizes; ``under``
    may name a single file."""
    path = CheckpointWriter(tmp_path).save(step=1, epoch=0, config={}, kind="lora", write_fn=_write)
    state = path / "recipe_state.pt"
    size = state.stat().st_size
    state.write_bytes(state.read_bytes()[:100])
    (path / "adapter" / "adapter_config.json").unlink()
    assert verify_checkpoint(path) == [f"{path / 'adapter' / 'adapter_config.json'}: missing",
                                       f"{state}: 100 bytes, {size} when saved"]
    assert verify_checkpoint(path, under=state) == [f"{state}: 100 bytes, {size} when saved"]

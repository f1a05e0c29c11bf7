"""A damaged checkpoint is never resumed as if intact: 4 KiB overwritten in an adapter is refused in one line naming
the file and an intact checkpoint; resume_from_checkpoint=latest_intact continues from that one; and with the check
turned off, a NaN loss right after resuming names the checkpoint as the suspect (not the learning rate)."""

import struct

from mtune._cli.main import main
from tests._helpers.recipes import TRAIN_CONFIG, read_metrics, run_recipe_in_process, train_overrides

ADAPTER = "adapter/adapter_model.safetensors"


def _overwrite_tensor_bytes(path, data: bytes):
    raw = bytearray(path.read_bytes())
    start = 8 + struct.unpack("<Q", raw[:8])[0]  # the tensors' bytes begin after the header
    raw[start:start + len(data)] = data[: len(raw) - start]
    path.write_bytes(bytes(raw))


def test_a_damaged_checkpoint_is_refused_and_latest_intact_resumes(capsys, tmp_path, tiny_checkpoint, tiny_data):
    overrides = train_overrides(tmp_path, tiny_checkpoint, tiny_data) + [
        "save_every_n_steps=1", "max_steps_per_epoch=2", "save_adapter_weights_only=true"]
    out = run_recipe_in_process("lora_single_device", overrides)
    (out / "final").rename(tmp_path / "final_aside")  # resume from the step_<N> dirs
    _overwrite_tensor_bytes(out / "step_2" / ADAPTER, b"\x5a" * 4096)
    resume = overrides + ["epochs=2", "resume_from_checkpoint=true"]
    code = main(["run", "lora_single_device", "--config", str(TRAIN_CONFIG), *resume])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert (f"error: checkpoint {out / 'step_2'} is damaged: {out / 'step_2' / ADAPTER}: checksum mismatch"
            in err), err
    assert f"hint: resume_from_checkpoint={out / 'step_1'} (or resume_from_checkpoint=latest_intact)" in err
    run_recipe_in_process("lora_single_device", overrides + ["epochs=2", "resume_from_checkpoint=latest_intact"])
    assert [row["step"] for row in read_metrics(out)] == [1, 2, 2, 3, 4]  # continued from step 1


def test_a_nan_loss_right_after_resuming_names_the_checkpoint(capsys, tmp_path, tiny_checkpoint, tiny_data):
    overrides = train_overrides(tmp_path, tiny_checkpoint, tiny_data) + ["max_steps_per_epoch=2",
                                                                         "save_adapter_weights_only=true"]
    out = run_recipe_in_process("lora_single_device", overrides)
    _overwrite_tensor_bytes(out / "final" / ADAPTER, struct.pack("<f", float("nan")) * 1024)
    code = main(["run", "lora_single_device", "--config", str(TRAIN_CONFIG), *overrides, "epochs=2",
                 "resume_from_checkpoint=true", "verify_checksums=false"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert f"error: step 3: the loss is nan, 1 step(s) after resuming from {out / 'final'}: suspect that checkpoint" \
        in err, err

"""End to end through the real command line: full, LoRA and QLoRA fine-tunes of a tiny model for a few steps."""

import json

import pytest
from safetensors import safe_open

from tests._helpers.recipes import losses, mtune_run, read_metrics, train_overrides

CONVENTIONAL_KEYS = {"step", "epoch", "loss", "lr", "tokens_per_second", "tokens_per_second_per_device",
                     "trained_tokens", "peak_memory_gib"}


@pytest.mark.slow
@pytest.mark.parametrize("recipe,extra,min_drop", [
    ("full_single_device", ["~lora", "clip_grad_norm=1.0"], 2.0),
    ("lora_single_device", ["lora.use_dora=true"], 0.5),
    ("lora_single_device", ["lora.quantize_base=true", "dtype=bf16"], 0.5),
])
def test_fine_tune_through_the_cli(tmp_path, tiny_checkpoint, tiny_data, recipe, extra, min_drop):
    overrides = train_overrides(tmp_path, tiny_checkpoint, tiny_data) + extra
    mtune_run(recipe, overrides)
    out = tmp_path / "out"
    rows = read_metrics(out)
    assert len(rows) == 6 and all(CONVENTIONAL_KEYS <= row.keys() for row in rows)
    assert all(row["tokens_per_second"] > 0 and row["trained_tokens"] > 0 for row in rows)
    run = losses(out)
    assert run[-1] < run[0] - min_drop, run
    state = json.loads((out / "final" / "mtune_state.json").read_text())
    assert state["step"] == 6 and state["config"]["model"]["checkpoint_dir"] == str(tiny_checkpoint)
    assert (out / "final" / "model" / "config.json").is_file()
    if recipe == "lora_single_device":
        with safe_open(out / "final" / "adapter" / "adapter_model.safetensors", "pt") as f:
            assert any(k.endswith("lora_A.weight") for k in f.keys())
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

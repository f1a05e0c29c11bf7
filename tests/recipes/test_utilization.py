"""mfu / hfu of a real run: the logged figures are the FLOPs counter's figure times the logged tokens/s over the
peak the run reports; the end-of-run summary states them."""

import json
import time

import pytest

from mtune.models import build_model_from_args
from mtune.models.hf_config import model_args_from_hf_config
from mtune.modules.lora import apply_lora
from mtune.training.memory.registry import MemoryConfig
from mtune.training.observe.flops import flops_per_token
from tests._helpers.recipes import read_metrics, run_recipe_in_process, train_overrides


def test_lora_run_logs_mfu_and_hfu(tmp_path, tiny_checkpoint, tiny_data, capfd):
    overrides = train_overrides(tmp_path, tiny_checkpoint, tiny_data, max_steps_per_epoch=3,
                                enable_activation_checkpointing=True, **{"dataset.packed": True})
    overrides.append("loss._component_=mtune.modules.loss.ChunkedCrossEntropyLoss")
    started = time.perf_counter()
    out = run_recipe_in_process("lora_single_device", overrides)
    run_s = time.perf_counter() - started
    printed = capfd.readouterr().err
    # The counter on the same model, built on meta: packed rows are max_seq_len (64) long.
    _, args = model_args_from_hf_config(json.loads((tiny_checkpoint / "config.json").read_text()))
    model = apply_lora(build_model_from_args(args), ["q_proj", "v_proj", "o_proj"], rank=8, alpha=16)
    # the chunked loss computes a plain head's gradients with its forward
    fpt = flops_per_token(model, 64, MemoryConfig(enable_activation_checkpointing=True))
    assert fpt.recompute > 0
    throughput = json.loads((out / "results.json").read_text())["throughput"]
    peak = throughput["peak_flops"]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["mfu"] == pytest.approx(fpt.model * row["tokens_per_second_per_device"] / peak, rel=1e-9)
        assert row["hfu"] == pytest.approx(fpt.hardware * row["tokens_per_second_per_device"] / peak, rel=1e-9)
    assert throughput["mfu"] == pytest.approx(fpt.model * throughput["tokens_per_second"] / peak, rel=1e-9)
    assert "measured" in throughput["peak_flops_source"]
    assert "mfu/hfu against cpu in fp32: " in printed and "| mfu " in printed and "| hfu " in printed
    # the first step's time, stated: within the run, and as results.json records it
    first = throughput["first_step_s"]
    assert 0 < first < run_s
    assert f"throughput over the last 2 steps (the first excluded: it took {first:.1f} s): " in printed

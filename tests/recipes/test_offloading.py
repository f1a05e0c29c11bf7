"""optimizer_offload and weight_offloading through the real recipes.

In-process, with the run's placement made distinct (``Placement("cpu", distinct=True)``: every move a real copy, as
between a GPU and its host): the same losses and trained weights as the plain run, bit for bit. Through the command
line, on the shipped tiny configs: the flags are accepted and the runs finish (on a CPU-only machine there is
nothing to move, which the log says)."""

import os
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from tests._helpers.recipes import REPO, losses, read_metrics, run_recipe_in_process, train_overrides

WEIGHT_OFFLOADING = "{type: block_level, blocks_per_group: 1, use_streams: true}"


@pytest.fixture
def distinct_placement(monkeypatch):
    from mtune.training import context, model_setup
    from mtune.training.placement import Placement

    def distinct(device, *args, **kwargs):
        return Placement(device, distinct=True)

    monkeypatch.setattr(context, "Placement", distinct)  # RunContext.placement: the recipes' one placement
    monkeypatch.setattr(model_setup, "Placement", distinct)  # setup_model's default (generate)


def _run(tmp_path, tiny_checkpoint, tiny_data, name, recipe, *extra, **changes):
    schedule = {"lr_scheduler._component_": "mtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
                "lr_scheduler.num_warmup_steps": 1}  # the schedule sets the lr of the host optimizer's groups
    overrides = train_overrides(tmp_path / name, tiny_checkpoint, tiny_data, max_steps_per_epoch=3,
                                gradient_accumulation_steps=2, batch_size=2, clip_grad_norm=1.0, **schedule,
                                **changes)
    return run_recipe_in_process(recipe, overrides + list(extra))


@pytest.mark.parametrize("recipe", ["lora_single_device", "full_single_device"])
def test_offloaded_runs_equal_the_plain_run(tmp_path, tiny_checkpoint, tiny_data, distinct_placement, recipe,
                                            capfd):
    extra = ["~lora"] if recipe == "full_single_device" else [f"weight_offloading={WEIGHT_OFFLOADING}"]
    plain = _run(tmp_path, tiny_checkpoint, tiny_data, "plain", recipe, *(["~lora"] if "full" in recipe else []),
                 **{"enable_activation_checkpointing": True})
    offloaded = _run(tmp_path, tiny_checkpoint, tiny_data, "offloaded", recipe, *extra, optimizer_offload="cpu",
                     enable_activation_checkpointing=True)
    log = capfd.readouterr().err
    assert "optimizer_offload=cpu: torch.optim.AdamW states in cpu memory" in log  # the copies really ran
    if recipe == "lora_single_device":
        assert "of frozen weights in 2 groups (block_level) wait in cpu memory" in log
    assert losses(offloaded) == losses(plain) and len(losses(plain)) == 3
    assert [row["lr"] for row in read_metrics(offloaded)] == [row["lr"] for row in read_metrics(plain)]
    part = "adapter/adapter_model.safetensors" if recipe == "lora_single_device" else "model/model.safetensors"
    expected, got = load_file(plain / "final" / part), load_file(offloaded / "final" / part)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    if recipe == "lora_single_device":  # the merged model is written from the base checkpoint's own tensors
        merged_a, merged_b = (load_file(o / "final" / "model" / "model.safetensors") for o in (plain, offloaded))
        assert all(torch.equal(merged_a[k], merged_b[k]) for k in merged_a)



def test_merged_export_of_a_random_weight_model_with_offloaded_weights(tmp_path, tiny_checkpoint, tiny_data,
                                                                        distinct_placement):
    # Without a base checkpoint the merged model is written from the run's own weights, which weight_offloading
    # keeps in host memory: they must be brought back (and copied out) for the export, not read from freed storage.
    from tests._helpers.tokenizers import write_tokenizer_files

    assert write_tokenizer_files(tmp_path / "tok", "qwen2") <= 512  # within the random tiny model's vocabulary
    random_weights = ["model.checkpoint_dir=null", "model.family=tiny", "model.size=tiny",
                      f"tokenizer.path={tmp_path / 'tok'}", "tokenizer.max_seq_len=512"]
    plain = _run(tmp_path, tiny_checkpoint, tiny_data, "plain", "lora_single_device", *random_weights)
    offloaded = _run(tmp_path, tiny_checkpoint, tiny_data, "offloaded", "lora_single_device", *random_weights,
                     f"weight_offloading={WEIGHT_OFFLOADING}")
    expected, got = (load_file(o / "final" / "model" / "model.safetensors") for o in (plain, offloaded))
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)

def test_generate_with_offloaded_weights(tiny_checkpoint, distinct_placement, capsys):
    from recipes import generate as generate_recipe

    def text(**keys):
        cfg = OmegaConf.create({"recipe": "generate", "device": "cpu", "dtype": "fp32", "max_new_tokens": 12,
                                "model": {"checkpoint_dir": str(tiny_checkpoint)},
                                "tokenizer": {"path": str(tiny_checkpoint)}, "prompt": "red green", **keys})
        generate_recipe.SCHEMA.fill_defaults(cfg)
        assert not generate_recipe.SCHEMA.check(cfg)
        return generate_recipe.main(cfg)

    plain = text()
    assert text(weight_offloading={"type": "leaf_level", "use_streams": False}) == plain
    assert text(weight_offloading={"type": "block_level", "blocks_per_group": 2}) == plain
    assert "of frozen weights in 1 groups (block_level) wait in cpu memory" in capsys.readouterr().err


def _mtune(*args, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(REPO), "MTUNE_QUIET": "1"}
    out = subprocess.run([sys.executable, "-m", "mtune", *args], capture_output=True, text=True, env=env,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.mark.slow
def test_both_flags_through_the_cli_on_the_tiny_configs(tmp_path):
    # lora_single_device reads both keys; one short run takes each flag end to end through the command line.
    out = _mtune("run", "lora_single_device", "--config", "tiny/lora_single_device", f"output_dir={tmp_path / 'lora'}",
                 "optimizer_offload=cpu", f"weight_offloading={WEIGHT_OFFLOADING}", "epochs=1",
                 "max_steps_per_epoch=2", "batch_size=4", "task_eval=null", "device=cpu")
    assert len(read_metrics(tmp_path / "lora")) >= 1 and (tmp_path / "lora" / "final" / "adapter").is_dir()
    assert "optimizer_offload=cpu: the model already computes in host memory" in out.stderr
    assert "weight_offloading: the model computes in host memory" in out.stderr

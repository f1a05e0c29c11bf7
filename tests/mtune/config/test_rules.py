"""Each incompatible-flag rule fires with a message naming the flags and the fix, and stays quiet otherwise."""

import json

import pytest
from omegaconf import OmegaConf

from mtune.config.rules import MEMORY_RULES


def problems(**cfg):
    conf = OmegaConf.create(cfg)
    return [p for rule in MEMORY_RULES for p in rule(conf)]


LORA = {"modules": ["q_proj", "v_proj"], "rank": 8, "alpha": 16}


def test_valid_configs_pass():
    assert problems(optimizer_in_bwd=True, gradient_accumulation_steps=1, clip_grad_norm=None, dtype="bf16") == []
    assert problems(lora={**LORA, "quantize_base": True}, enable_activation_checkpointing=True,
                    enable_activation_offloading=True) == []


@pytest.mark.parametrize("cfg,expected", [
    (dict(optimizer_in_bwd=True, gradient_accumulation_steps=4),
     "optimizer_in_bwd=true cannot be combined with gradient_accumulation_steps=4: set gradient_accumulation_steps=1 "
     "or optimizer_in_bwd=false"),
    (dict(optimizer_in_bwd=True, clip_grad_norm=1.0), "set clip_grad_norm=null or optimizer_in_bwd=false"),
    (dict(optimizer_in_bwd=True, dtype="fp16"), "set dtype=bf16 or dtype=fp32, or optimizer_in_bwd=false"),
    (dict(lora={"quantize_base": True}), "lora.quantize_base=true without lora.modules"),
    (dict(lora={**LORA, "modules": ["qproj"]}), "lora.modules has unknown names ['qproj']"),
    (dict(enable_activation_offloading=True), "set enable_activation_checkpointing=true or "
     "enable_activation_offloading=false"),
    (dict(lora={**LORA, "modules": ["lm_head"]}, model={"tie_embeddings": True}),
     "remove lm_head from lora.modules"),
])
def test_each_rule(cfg, expected):
    found = problems(**cfg)
    assert len(found) == 1 and expected in found[0], found


def test_tied_lm_head_read_from_checkpoint_config(tmp_path):
    lora = {**LORA, "modules": ["q_proj", "lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "tie_word_embeddings": True}))
    assert len(problems(lora=lora, model={"checkpoint_dir": str(tmp_path)})) == 1
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))  # absent: untied
    assert problems(lora=lora, model={"checkpoint_dir": str(tmp_path)}) == []

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


# ---- fp8 weight storage and op-level selective checkpointing (issue 13, items 3-4)
def test_fp8_storage_and_selective_checkpointing_pass_where_they_apply():
    assert problems(lora=LORA, weight_storage_dtype="float8_e4m3fn", weight_storage_skip_patterns=["*.down_proj"],
                    enable_activation_checkpointing=True, activation_checkpointing_policy="selective_op",
                    enable_activation_offloading=True) == []
    assert problems(weight_storage_dtype=None, activation_checkpointing_policy="block") == []


@pytest.mark.parametrize("cfg,keys", [
    (dict(weight_storage_dtype="float8_e4m3fn", lora={**LORA, "quantize_base": True}),
     ["weight_storage_dtype=float8_e4m3fn", "lora.quantize_base=true", "weight_storage_dtype=null",
      "lora.quantize_base=false"]),
    (dict(weight_storage_dtype="float8_e5m2"),  # a full fine-tune: no lora node
     ["weight_storage_dtype=float8_e5m2", "no lora node", "weight_storage_dtype=null"]),
    (dict(lora=LORA, weight_storage_dtype="float8_e4m3fn", weight_storage_skip_patterns=[3]),
     ["weight_storage_skip_patterns", "got 3"]),
    (dict(activation_checkpointing_policy="selective_op"),
     ["activation_checkpointing_policy=selective_op", "enable_activation_checkpointing=true",
      "activation_checkpointing_policy=block"]),
])
def test_fp8_storage_and_selective_checkpointing_rules_name_both_keys(cfg, keys):
    found = problems(**cfg)
    assert len(found) == 1 and all(k in found[0] for k in keys), found

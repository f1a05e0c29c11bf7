"""Each incompatible-flag rule fires with a message naming the flags and the fix, and stays quiet otherwise."""

import json

import pytest
from omegaconf import OmegaConf

from mtune.training.memory.registry import MEMORY_RULES


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
    (dict(lora={"quantize_base": True, "modules": []}), "lora.quantize_base=true without lora.modules"),
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


# ---- optimizer_offload and weight_offloading
ADAMW = {"_component_": "torch.optim.AdamW", "lr": 1e-4}
OFFLOAD = {"type": "block_level", "blocks_per_group": 1, "use_streams": True}


def test_offloading_configs_that_work_pass():
    assert problems(optimizer_offload="cpu", optimizer=ADAMW, dtype="bf16", gradient_accumulation_steps=4,
                    clip_grad_norm=1.0) == []
    assert problems(lora={**LORA, "quantize_base": True}, weight_offloading=OFFLOAD, optimizer_offload="cpu",
                    optimizer=ADAMW, enable_activation_checkpointing=True, enable_activation_offloading=True) == []


@pytest.mark.parametrize("cfg,keys", [
    (dict(optimizer_offload="cpu", optimizer={"_component_": "bitsandbytes.optim.AdamW8bit"}),
     ("optimizer_offload=cpu", "optimizer._component_=bitsandbytes.optim.AdamW8bit")),
    (dict(optimizer_offload="cpu", optimizer={"_component_": "torchao.optim.AdamW8bit"}),
     ("optimizer_offload=cpu", "optimizer._component_=torchao.optim.AdamW8bit")),
    (dict(optimizer_offload="cpu", optimizer=ADAMW, optimizer_in_bwd=True),
     ("optimizer_offload=cpu", "optimizer_in_bwd=true")),
    (dict(optimizer_offload="cpu", optimizer=ADAMW, dtype="fp16"), ("optimizer_offload=cpu", "dtype=fp16")),
    (dict(weight_offloading=OFFLOAD), ("weight_offloading", "lora")),
    (dict(weight_offloading=OFFLOAD, lora=LORA, compile=True), ("weight_offloading", "compile=true")),
])
def test_offloading_pairs_are_refused_naming_both_keys(cfg, keys):
    found = problems(**cfg)
    assert len(found) == 1 and all(key in found[0] for key in keys), found


def test_offloading_keys_are_checked_by_mtune_validate(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    config = repo / "recipes" / "configs" / "tiny" / "lora_single_device.yaml"
    env = {"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "mtune", "validate", str(config), "optimizer_offload=gpu",
                          "weight_offloading={type: block, blocks_per_group: 0}", "compile=true"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0
    for expected in ("optimizer_offload: must be one of cpu", "weight_offloading.type: must be one of block_level, "
                     "leaf_level", "weight_offloading.blocks_per_group: must be >= 1"):
        assert expected in out.stdout + out.stderr, out.stdout + out.stderr


# ---- fp8 weight storage and op-level selective checkpointing
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


def test_fp8_storage_and_selective_checkpointing_are_checked_by_mtune_validate():
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    config = repo / "recipes" / "configs" / "tiny" / "lora_single_device.yaml"
    out = subprocess.run([sys.executable, "-m", "mtune", "validate", str(config), "weight_storage_dtype=float8_e4m3fn",
                          "lora.quantize_base=true", "activation_checkpointing_policy=selective_op"],
                         capture_output=True, text=True, env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"},
                         timeout=120)
    assert out.returncode == 1 and "2 problems" in out.stdout, out.stdout + out.stderr
    assert "error: weight_storage_dtype=float8_e4m3fn cannot be combined with lora.quantize_base=true" in out.stdout
    assert "error: activation_checkpointing_policy=selective_op needs enable_activation_checkpointing=true" in out.stdout


@pytest.mark.parametrize("node, component, expected", [
    ("loss", "torch.nn.CrossEntropyLoss", "loss: torch.nn.modules.loss.CrossEntropyLoss is not a loss mtune's training "
     "loop can call"),
    ("optimizer", "torch.optim.LBFGS", "optimizer: torch.optim.lbfgs.LBFGS.step needs closure: mtune's training loop "
     "calls optimizer.step() once per step with no arguments"),
])
def test_a_component_the_loop_cannot_call_is_refused_before_the_first_step(node, component, expected):
    """Both imported and built fine, passed `mtune validate`, then failed inside the first step with a traceback
    (`CrossEntropyLoss.forward() takes 3 positional arguments but 4 were given`; `step() missing ... 'closure'`)."""
    from mtune.config.rules import RUN_RULES

    def found(path):
        conf = OmegaConf.create({node: {"_component_": path}})
        return [p for rule in RUN_RULES for p in rule(conf)]

    (problem,) = found(component)
    assert problem.startswith(expected), problem
    for fine in {"loss": ["mtune.modules.loss.ChunkedCrossEntropyLoss", "mtune.modules.loss.CrossEntropyLoss",
                          "mtune.modules.preference_loss.DPOLoss", "torch.nn.CrossEntropyLos"],  # a typo: the schema's
                 "optimizer": ["torch.optim.AdamW", "torch.optim.SGD", "bitsandbytes.optim.PagedAdamW8bit"]}[node]:
        assert found(fine) == [], fine


# ---- the run's own rules (mtune.config.rules)
@pytest.mark.parametrize("optimizer, expected", [
    ({"lr": 0, "weight_decay": 0, "eps": 1e-8, "betas": [0.0, 0.999]}, []),  # the bounds that are allowed
    ({"eps": 0}, ["optimizer.eps: must be > 0, got 0"]),
    ({"betas": [0.9, 1.0]}, ["optimizer.betas: must be two numbers in [0, 1), e.g. [0.9, 0.999], got [0.9, 1.0]"]),
    ({"betas": [-0.1, 0.9]}, ["optimizer.betas: must be two numbers in [0, 1), e.g. [0.9, 0.999], got [-0.1, 0.9]"]),
    ({"betas": [0.9, 0.99, 0.999]},
     ["optimizer.betas: must be two numbers in [0, 1), e.g. [0.9, 0.999], got [0.9, 0.99, 0.999]"]),
    ({"weight_decay": -0.01}, ["optimizer.weight_decay: must be >= 0, got -0.01"]),
])
def test_optimizer_values_at_their_bounds(optimizer, expected):
    """eps 0 divides by zero and a beta of 1 never forgets: both refused, 0 for lr/weight_decay/beta allowed."""
    from mtune.config.rules import check_optimizer_values

    cfg = OmegaConf.create({"optimizer": {"_component_": "torch.optim.AdamW", **optimizer}})
    assert check_optimizer_values(cfg) == expected


@pytest.mark.parametrize("base, checkpoint_dir, refused", [
    ("/m/base", "/m/base", False), ("/m/base", None, False), (None, "/m/base", False), ("/m/base", "/m/other", True)])
def test_merge_base_and_checkpoint_dir_must_agree(base, checkpoint_dir, refused):
    """merge_lora's base_model_dir and model.checkpoint_dir may both be set only to the same directory."""
    from mtune.config.rules import check_merge_base

    cfg = OmegaConf.create({"base_model_dir": base, "model": {"checkpoint_dir": checkpoint_dir}})
    assert check_merge_base(cfg) == (["base_model_dir and model.checkpoint_dir differ: set only one of them (the "
                                      "adapter's base model)"] if refused else [])

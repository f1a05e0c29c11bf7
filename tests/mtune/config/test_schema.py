"""Key declarations: type checks, unknown keys with suggestions, defaults, rules, rendering; validate_config."""

import pytest
from omegaconf import OmegaConf

from mtune.config import REQUIRED, Key, KeyGroup, Node, RecipeSchema, render_help, render_markdown, validate_config
from mtune.config.keys import MODEL_NODES, RUN_KEYS, TRAINING_NODES
from mtune.config.rules import RUN_RULES
from mtune.training.memory.registry import LORA_KEYS, MEMORY_KEYS, MEMORY_RULES

SCHEMA = RecipeSchema([RUN_KEYS, MEMORY_KEYS, MODEL_NODES, TRAINING_NODES, LORA_KEYS], rules=RUN_RULES + MEMORY_RULES)


def good_config(**changes):
    cfg = OmegaConf.create(
        {
            "output_dir": "/tmp/out",
            "model": {"checkpoint_dir": "/tmp/m"},
            "tokenizer": {"max_seq_len": 512},
            "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-4},
            "dataset": {"_component_": "argparse.Namespace", "data_files": "x.json"},
            "lora": {"rank": 4},
        }
    )
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def test_good_config_has_no_problems_and_defaults_fill():
    cfg = good_config()
    assert SCHEMA.check(cfg) == []
    SCHEMA.fill_defaults(cfg)
    assert cfg.dtype == "bf16" and cfg.epochs == 1 and cfg.clip_grad_norm is None and cfg.lr_scheduler is None
    assert cfg.lora.rank == 4 and cfg.lora.alpha == 16.0 and list(cfg.lora.modules) == ["q_proj", "v_proj"]
    assert cfg.enable_activation_checkpointing is False


def test_misspelt_key_is_an_error_with_suggestion():
    assert SCHEMA.check(good_config(enable_activation_checkpionting=True)) == [
        "enable_activation_checkpionting: unknown key (did you mean 'enable_activation_checkpointing'?)"
    ]
    assert SCHEMA.check(good_config(**{"lora.rnak": 2})) == ["lora.rnak: unknown key (did you mean 'lora.rank'?)"]


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("batch_size", "two", "batch_size: expected int, got str 'two'"),
        ("batch_size", True, "batch_size: expected int, got bool True"),
        ("batch_size", None, "batch_size: expected int, got null"),
        ("compile", "yes", "compile: expected bool, got str 'yes'"),
        ("dtype", "fp8", "dtype: must be one of fp32, bf16, fp16, got 'fp8'"),
        ("optimizer", "adamw", "optimizer: expected a mapping of keys, got str 'adamw'"),
        ("lora.alpha", "big", "lora.alpha: expected float, got str 'big'"),
    ],
)
def test_wrong_type_names_the_key(key, value, message):
    assert SCHEMA.check(good_config(**{key: value})) == [message]


def test_optional_keys_accept_null_and_int_for_float():
    assert SCHEMA.check(good_config(max_steps_per_epoch=None, clip_grad_norm=1, resume_from_checkpoint="/x")) == []


def test_missing_required_and_rules():
    cfg = good_config()
    del cfg["output_dir"]
    assert SCHEMA.check(cfg) == ["output_dir: missing required key (directory for checkpoints, metrics.jsonl and logs)"]
    problems = SCHEMA.check(good_config(optimizer_in_bwd=True, gradient_accumulation_steps=2, clip_grad_norm=1.0))
    assert len(problems) == 2 and all(p.startswith("optimizer_in_bwd=true") for p in problems)
    assert "dataset_val" in SCHEMA.check(good_config(eval_every_n_steps=10))[0]


def test_duplicate_declarations_are_refused():
    with pytest.raises(ValueError, match="'seed' is declared by both run and mine"):
        RecipeSchema([RUN_KEYS, KeyGroup("mine", [Key("seed", int, 1)])])


def test_render_markdown_and_help_use_the_declarations():
    schema = RecipeSchema([KeyGroup("g", [Key("dtype", str, "bf16", "storage dtype", choices=("fp32", "bf16")),
                                          Key("n", int, REQUIRED, "count"), Node("opt", "an optimizer")])])
    table = render_markdown(schema)
    assert "| `dtype` | fp32\\|bf16 | `bf16` | storage dtype |" in table
    assert "| `n` | int | `required` | count |" in table
    text = render_help(schema)
    assert "dtype" in text and "storage dtype [fp32|bf16, default bf16]" in text and "opt" in text


def test_validate_config_reports_components_keywords_interpolations_and_paths(tmp_path):
    cfg = good_config(**{"optimizer.lrr": 1.0, "loss": {"_component_": "torch.nn.CrossEntropyLos"},
                         "tokenizer.path": "${nowhere}/tok", "model.checkpoint_dir": str(tmp_path / "absent"),
                         "dataset.data_files": [str(tmp_path), str(tmp_path / "b.json")]})
    report = validate_config(cfg, SCHEMA)
    assert "optimizer.lrr: AdamW does not accept 'lrr' (did you mean 'lr'?)" in report.errors
    assert any(e.startswith("loss._component_:") and "torch.nn.CrossEntropyLoss" in e for e in report.errors)
    assert any(e.startswith("tokenizer.path: cannot resolve") for e in report.errors)
    assert report.warnings == [
        f"model.checkpoint_dir: path does not exist: {tmp_path / 'absent'}",
        f"dataset.data_files: path does not exist: {tmp_path / 'b.json'}",
    ]
    assert not report.ok
    assert validate_config(good_config(**{"model.checkpoint_dir": str(tmp_path)}), SCHEMA).ok

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


def test_validate_config_lists_only_components_outside_the_trusted_packages():
    """`mtune validate` lists the code a config would call from outside mtune/torch/torchao/bitsandbytes, and only it."""
    lr_scheduler = {"_component_": "mtune.training.lr_schedulers.get_cosine_schedule_with_warmup"}
    report = validate_config(good_config(lr_scheduler=lr_scheduler), SCHEMA)
    # optimizer (torch) and lr_scheduler (mtune) are trusted; the dataset's argparse.Namespace is not
    assert report.foreign == ["dataset: argparse.Namespace"]


@pytest.mark.parametrize("epochs, warmup, warned", [(None, 4, False), (None, 5, True), (2, 9, False), (2, 10, True)])
def test_validate_config_warns_of_a_warmup_as_long_as_the_capped_run(epochs, warmup, warned):
    """A warmup of exactly max_steps_per_epoch x epochs (epochs absent: 1) leaves no step at the full lr, one less does."""
    changes = {"max_steps_per_epoch": 5, "lr_scheduler": {
        "_component_": "mtune.training.lr_schedulers.get_cosine_schedule_with_warmup", "num_warmup_steps": warmup}}
    if epochs is not None:
        changes["epochs"] = epochs
    report = validate_config(good_config(**changes), SCHEMA)
    total = 5 * (epochs or 1)  # by hand: the cap times the epochs, epochs defaulting to 1
    expected = [f"lr_scheduler.num_warmup_steps={warmup} is not shorter than the run (at most max_steps_per_epoch x "
                f"epochs = 5 x {epochs or 1}: {total} steps): the learning rate would never reach optimizer.lr; lower "
                "num_warmup_steps (a few percent of the steps is usual) or train longer (max_steps_per_epoch cuts the "
                "run short: it would run all in warmup)"]
    assert report.errors == [] and report.notes == []
    assert [w for w in report.warnings if "num_warmup_steps" in w] == (expected if warned else [])


@pytest.mark.parametrize("warmup, notes", [(0, []), (3, [
    "lr_scheduler.num_warmup_steps=3: the run's total steps are known only once the dataset is read, so `mtune run` "
    "checks the warmup against them before the first step"])])
def test_validate_config_notes_an_uncapped_warmup_only_when_there_is_one(warmup, notes):
    """Without max_steps_per_epoch only the run can check a warmup; no warmup (0) needs no note."""
    lr_scheduler = {"_component_": "mtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
                    "num_warmup_steps": warmup}
    report = validate_config(good_config(lr_scheduler=lr_scheduler), SCHEMA)
    assert report.errors == [] and report.notes == notes


@pytest.mark.parametrize("value", [0.0, 0.5, 1.0, 1.5])
def test_key_bounds_include_at_most_and_exclude_above(value):
    """`above`/`at_most` (top_p's (0, 1]) and `at_least`/`below` (lora.dropout's [0, 1)) bound as their names say."""
    top_p, dropout = Key("p", float, None, above=0, at_most=1), Key("p", float, 0.0, at_least=0, below=1)
    # by hand: 0 is out of (0, 1] and in [0, 1); 1 is in (0, 1] and out of [0, 1)
    in_top_p, in_dropout = 0 < value <= 1, 0 <= value < 1
    assert top_p.check(value, "p") == ([] if in_top_p else [f"p: must be > 0 and <= 1 (or null), got {value!r}"])
    assert dropout.check(value, "p") == ([] if in_dropout else [f"p: must be >= 0 and < 1, got {value!r}"])


def test_a_required_node_set_to_null_is_a_problem():
    """A required node written as null is refused like a missing one (an optional one may be null)."""
    schema = RecipeSchema([KeyGroup("g", [Node("model", "the model to train", required=True), Node("loss", "loss")])])
    assert schema.check(OmegaConf.create({"model": None, "loss": None})) == ["model: must be set (the model to train)"]
    assert schema.check(OmegaConf.create({"loss": None})) == ["model: missing required key (the model to train)"]

"""mtune plan on the preference recipes: a pair batch is twice the rows, the reference copy adds one model's
weights and the other two choices none, the precompute pass is a phase of its own, and --fit searches the reference
choice losslessly (a copy that does not fit becomes adapters_off / precomputed) and never swaps a DPO loss."""

import pytest

from mtune.training.memory.registry import MemoryConfig
from mtune.training.memory.techniques.chunked_loss import CHUNKED_LOSS
from mtune.training.planning.candidates import KNOBS
from mtune.training.planning.cost import model_facts
from mtune.training.planning.plan import plan_memory
from tests._helpers.shipped import shipped_on_tiny


def _cfg(config, *overrides):
    from mtune._cli.catalog import find_config, find_recipe, load_recipe_module
    from mtune._cli.run import load_and_check

    recipe = config.split("/")[1]
    return load_and_check(load_recipe_module(find_recipe(recipe)), find_config(config), ["device=cuda", *overrides])


@pytest.fixture(scope="module")
def plans():
    return {kind: plan_memory(_cfg("tiny/lora_dpo_single_device", f"reference={kind}"))
            for kind in ("adapters_off", "precomputed", "copy")}


def test_the_reference_choices_as_planned(plans):
    copy_extra = plans["copy"].device["parameters"] - plans["adapters_off"].device["parameters"]
    tiny = _cfg("tiny/lora_dpo_single_device")
    weights = plan_memory(_cfg("tiny/full_single_device", "batch_size=1")).device["parameters"]
    assert copy_extra == weights  # a second model, frozen (the full fine-tune's parameters, same dtype)
    assert plans["precomputed"].device["parameters"] == plans["adapters_off"].device["parameters"]
    assert plans["copy"].device_peak_bytes == plans["adapters_off"].device_peak_bytes + copy_extra
    assert tiny.reference == "adapters_off"


def test_a_pair_batch_is_twice_the_rows():
    sft = plan_memory(_cfg("tiny/lora_single_device"))
    dpo = plan_memory(_cfg("tiny/lora_dpo_single_device", "reference=precomputed"))
    assert sft.batch == dpo.batch  # the same batch_size of samples
    assert 1.8 < dpo.device["activations"] / sft.device["activations"] < 2.2


def test_packed_pairs_plan_the_tokens_of_as_many_pairs(plans):
    """``dataset.packed``: ``batch_size`` rows of 2 x max_seq_len tokens, each the longest pair (two documents): the
    tokens of an unpacked batch of as many pairs, so about its activations (the block-causal path adds its mask).
    Mutation seen failing: rows of max_seq_len (``row_length`` not doubled), half the activations."""
    packed = plan_memory(_cfg("tiny/lora_dpo_single_device", "dataset.packed=true"))
    assert packed.batch == plans["adapters_off"].batch
    assert 1.0 <= packed.device["activations"] / plans["adapters_off"].device["activations"] < 1.1
    assert packed.device["parameters"] == plans["adapters_off"].device["parameters"]


def test_fit_searches_the_reference_losslessly():
    knob = next(k for k in KNOBS if k.name == "reference")
    copy = knob.choices(_cfg("tiny/lora_dpo_single_device", "reference=copy"))
    exact = {"reference": "adapters_off", "reference_storage_dtype": None}
    assert [(c.level, c.overrides, c.lossy) for c in copy] == [
        (0, {}, None), (1, {"reference": "copy", "reference_storage_dtype": "float8_e4m3fn"}, "fp8 reference weights"),
        (2, exact, None)]  # the copy's fp8 storage lossy, no copy lossless
    full = knob.choices(_cfg("tiny/full_dpo_single_device", "reference=copy"))
    assert full[2].overrides == {"reference": "precomputed", "reference_storage_dtype": None}
    fp8 = knob.choices(_cfg("tiny/lora_dpo_single_device", "reference=copy", "reference_storage_dtype=float8_e5m2"))
    assert [c.lossy for c in fp8] == [None, None, None]  # lossy only against a more exact copy than the user's
    assert [c.overrides for c in knob.choices(_cfg("tiny/lora_dpo_single_device"))] == [{}]
    assert [c.overrides for c in knob.choices(_cfg("tiny/lora_single_device"))] == [{}]
    cfg = _cfg("tiny/lora_dpo_single_device")
    memory = MemoryConfig.from_config(cfg)
    assert [c.overrides for c in CHUNKED_LOSS.fit_choices(memory[CHUNKED_LOSS], memory, model_facts(cfg))] == [{}]


def test_fit_and_oom_advice_offer_the_chunked_loss_where_it_is_a_choice():
    """The chunked-loss technique: a plain cross-entropy config is offered the plain loss (level 0) or the chunked
    one (level 1), each a whole loss node, both lossless, and its OOM advice names the chunked loss; a chunked config
    keeps its num_chunks in the chunked choice and gets no advice; a DPO config gets none (its loss is no choice).
    Oracle: the loss nodes written out by hand. Mutations seen failing: the levels swapped; level 0 an empty
    override (the user's chunked loss kept); the user's num_chunks dropped; the preference loss given the advice;
    the advice dropped; no fit_knob (the loss left out of the search's KNOBS)."""
    from mtune.training.memory.footprint import advice

    plain, chunked = "mtune.modules.loss.CrossEntropyLoss", "mtune.modules.loss.ChunkedCrossEntropyLoss"

    def offered(*overrides):
        memory = MemoryConfig.from_config(cfg := _cfg(*overrides))
        choices = CHUNKED_LOSS.fit_choices(memory[CHUNKED_LOSS], memory, model_facts(cfg))
        return [(c.level, c.overrides, c.lossy) for c in choices], CHUNKED_LOSS.oom_advice(memory[CHUNKED_LOSS], memory)

    assert offered("tiny/lora_single_device") == (
        [(0, {"loss": {"_component_": plain}}, None), (1, {"loss": {"_component_": chunked}}, None)],
        [advice("chunked_loss", f"loss._component_={chunked}")])
    assert offered("tiny/lora_single_device", f"loss={{_component_: {chunked}, num_chunks: 16}}") == (
        [(0, {"loss": {"_component_": plain}}, None), (1, {"loss": {"_component_": chunked, "num_chunks": 16}}, None)],
        [])
    assert offered("tiny/lora_dpo_single_device") == ([(0, {}, None)], [])
    knob = next(k for k in KNOBS if k.name == "loss")  # the --fit search's dimension for it
    assert [(c.level, c.overrides) for c in knob.choices(_cfg("tiny/lora_single_device"))] == [
        (0, {"loss": {"_component_": plain}}), (1, {"loss": {"_component_": chunked}})]


@pytest.mark.parametrize("config", ["llama3_1/8B_lora_dpo_single_device", "qwen3/8B_lora_dpo_single_device"])
def test_the_8b_configs_plan(config):
    """Each shipped LoRA DPO config validates (``shipped_on_tiny`` loads it through the recipe's checks) and plans on
    its family's tiny model, with the reference it ships (adapters off: no second copy)."""
    _, _, cfg = shipped_on_tiny(config)
    assert cfg.reference == "adapters_off"
    plan = plan_memory(cfg)
    assert plan.device_peak_bytes > 0 and plan.batch == {"batch_size": 2, "seq_len": 64, "accumulation": 8}


def test_validate_names_the_preference_problems():
    from mtune._cli.catalog import find_config, find_recipe, load_recipe_module
    from mtune.config import load_config, validate_config

    full = load_recipe_module(find_recipe("full_dpo_single_device")).SCHEMA
    report = validate_config(load_config(find_config("tiny/full_dpo_single_device"), [
        "reference=adapters_off", "loss._component_=mtune.modules.loss.CrossEntropyLoss", "~loss.beta",
        "~loss.label_smoothing"]), full)
    assert any("reference=adapters_off needs LoRA adapters to disable" in e for e in report.errors), report.errors
    assert any("a preference recipe needs a preference loss" in e for e in report.errors), report.errors
    lora = load_recipe_module(find_recipe("lora_dpo_single_device")).SCHEMA
    assert validate_config(load_config(find_config("tiny/lora_dpo_single_device"), ["reference=copy"]),
                           lora).errors == []
    report = validate_config(load_config(find_config("tiny/lora_dpo_single_device"), ["reference=frozen"]), lora)
    assert any("reference: must be one of adapters_off, precomputed, copy" in e for e in report.errors)
    report = validate_config(load_config(find_config("tiny/lora_dpo_single_device"), [
        "reference_storage_dtype=float8_e4m3fn"]), lora)
    assert report.errors == ["reference_storage_dtype=float8_e4m3fn stores a reference copy, but reference is "
                             "adapters_off: set reference=copy, or reference_storage_dtype=null"], report.errors
    sharded = load_recipe_module(find_recipe("full_dpo_distributed")).SCHEMA
    report = validate_config(load_config(find_config("tiny/full_dpo_distributed"), [
        "reference=copy", "reference_storage_dtype=float8_e5m2"]), sharded)
    assert any("not supported by the distributed recipes yet" in e for e in report.errors), report.errors


def test_a_reference_cache_dir_without_a_precomputed_reference_is_refused():
    """reference_cache_dir does nothing unless the reference is precomputed (as reference_storage_dtype does nothing
    but for a copy). Before, it was dropped silently and the run trained with the other reference."""
    from mtune._cli.catalog import find_config, find_recipe, load_recipe_module
    from mtune.config import load_config, validate_config

    for recipe, overrides, kind in (("lora_dpo_single_device", [], "adapters_off"),
                                    ("full_dpo_single_device", ["reference=copy"], "copy")):
        schema = load_recipe_module(find_recipe(recipe)).SCHEMA
        report = validate_config(load_config(find_config(f"tiny/{recipe}"), [
            "reference_cache_dir=/tmp/cache", *overrides]), schema)
        assert report.errors == [f"reference_cache_dir=/tmp/cache holds precomputed reference log-probs, but reference "
                                 f"is {kind}: set reference=precomputed, or reference_cache_dir=null"], report.errors
    for recipe, overrides in (("lora_dpo_single_device", ["reference=precomputed"]), ("full_dpo_single_device", [])):
        schema = load_recipe_module(find_recipe(recipe)).SCHEMA
        assert validate_config(load_config(find_config(f"tiny/{recipe}"), [
            "reference_cache_dir=/tmp/cache", *overrides]), schema).errors == []


def test_ls_lists_the_four_recipes_and_help_the_reference_keys():
    import os
    import subprocess
    import sys

    from tests._helpers.paths import REPO

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    listed = subprocess.run([sys.executable, "-m", "mtune", "ls"], capture_output=True, text=True, env=env).stdout
    for recipe in ("lora_dpo_single_device", "lora_dpo_distributed", "full_dpo_single_device", "full_dpo_distributed"):
        assert f"tiny/{recipe}" in listed
    shown = subprocess.run([sys.executable, "-m", "mtune", "run", "lora_dpo_single_device", "--help"],
                           capture_output=True, text=True, env=env).stdout
    assert "reference_cache_dir" in shown and "[adapters_off|precomputed|copy|None, default null]" in shown


def test_the_reference_cache_is_not_a_run_of_the_output_dir(tmp_path):
    """A cache, so the output-dir rule does not apply to it: a directory holding only the cache is free, and
    overwrite_output_dir deletes the earlier run but keeps the cache."""
    from mtune.training.context import claim_output_dir

    (tmp_path / "reference_cache").mkdir()
    (tmp_path / "reference_cache" / "train.json").write_text("{}")
    claim_output_dir(tmp_path, resuming=False, overwrite=False, is_main=True)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    claim_output_dir(tmp_path, resuming=False, overwrite=True, is_main=True)
    assert not (tmp_path / "metrics.jsonl").exists() and (tmp_path / "reference_cache" / "train.json").exists()


def test_an_fp8_reference_copy_planned_as_built():
    """``reference_storage_dtype``: the copy's block linears stored as fp8 codes (1 byte a weight) with one fp32
    scale per row. Planned bytes of the copy == the bytes of the copy the run builds (what its tracker counts:
    `PreferenceObjective.frozen_tensors`) == an independent count from the tiny model's config.json: the exact
    fp32 copy less 3 bytes per block-linear weight plus 4 per block-linear row. Mutation seen failing: the planner's
    copy built without ``reference_storage_dtype`` (the fp32 copy's bytes)."""
    import json

    import torch

    from mtune.assets import tiny_model_dir
    from mtune.training.memory.registry import reference_copy_memory
    from mtune.training.memory.tensor_bytes import tensor_storage_bytes
    from mtune.training.model_setup import resolve_model_source, setup_model

    def params(*overrides):
        return plan_memory(_cfg("tiny/lora_dpo_single_device", "device=cpu", *overrides)).device["parameters"]

    exact = params("reference=copy") - params()
    fp8 = params("reference=copy", "reference_storage_dtype=float8_e4m3fn") - params()
    c = json.loads((tiny_model_dir() / "config.json").read_text())
    hidden, inter, heads, kv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c[
        "num_key_value_heads"]
    q, k = heads * c["head_dim"], kv * c["head_dim"]
    rows = (q + 2 * k + hidden + 2 * inter + hidden) * c["num_hidden_layers"]  # q, k, v, o, gate, up, down
    weights = (hidden * (q + 2 * k) + q * hidden + 3 * hidden * inter) * c["num_hidden_layers"]
    assert fp8 == exact - 3 * weights + 4 * rows
    source = resolve_model_source(_cfg("tiny/lora_dpo_single_device").model)
    copy, _ = setup_model(source, device=torch.device("cpu"), dtype=torch.float32,
                          memory=reference_copy_memory("float8_e4m3fn"), trainable=False)
    built, _ = tensor_storage_bytes([*copy.parameters(), *copy.buffers()])
    assert built == fp8
    assert copy.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn

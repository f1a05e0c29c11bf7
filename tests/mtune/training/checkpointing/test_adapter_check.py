"""Every adapter mtune loads or merges passes one check (`check_adapter`): adapter_config.json against the tensors of
adapter_model.safetensors, and both against the model. A broken adapter is refused with one line naming the file
and the first disagreement, whichever way it is loaded: training's lora.adapter_dir (`setup_model`), generate's
adapter_dir (`lora_node_from_adapter`, then `setup_model`), merge_lora (`read_adapter`), a resume
(`load_peft_adapter`)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtune.training.checkpointing.adapter_check import check_adapter
from mtune.training.checkpointing.hf import read_hf_config
from mtune.training.checkpointing.peft import (
    AdapterError, load_peft_adapter, lora_node_from_adapter, read_adapter, save_peft_adapter,
)
from mtune.training.model_setup import resolve_model_source, setup_model
from tests._helpers.lora import lora_cfg, trained_lora_model
from tests._helpers.models import write_tiny_hf_model

QV = ["q_proj", "v_proj"]
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
WEIGHTS = "adapter_model.safetensors"
Q0 = "base_model.model.model.layers.0.self_attn.q_proj."  # peft's key prefix of layer 0's q_proj


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tiny Llama base (hidden size 256, 2 layers) and adapters saved from LoRA models on it: q/v at rank 8
    (``good``) and 16, and all seven linears."""
    root = tmp_path_factory.mktemp("adapters")
    base = write_tiny_hf_model(root, "llama3_1")
    for name, kwargs in {"good": {}, "rank16": dict(rank=16), "seven": dict(modules=SEVEN)}.items():
        model = trained_lora_model(base, **{"modules": QV, **kwargs})
        save_peft_adapter(model, root / name, base_model_name_or_path=base)
    return root, base


def variant(made, tmp_path, source="good", config=None, tensors=None):
    """A copy of the adapter ``source``: ``config``'s fields replace its adapter_config.json's, ``tensors`` (a
    function of its state dict) rewrites adapter_model.safetensors."""
    out = tmp_path / "adapter"
    shutil.copytree(made[0] / source, out)
    if config:
        path = out / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if tensors:
        save_file(tensors(load_file(out / WEIGHTS)), out / WEIGHTS)
    return out


def without(part):
    return lambda tensors: {k: v for k, v in tensors.items() if part not in k}


def for_hidden_128(tensors):  # lora_A as an adapter trained on a model of hidden size 128 has it
    return {k: v[:, :128].contiguous() if ".lora_A." in k else v for k, v in tensors.items()}


def with_a_third_layer(tensors):  # the adapter of a 3-layer model: layer 1's tensors again as layer 2's
    third = {k.replace("layers.1.", "layers.2."): v.clone() for k, v in tensors.items() if "layers.1." in k}
    return {**tensors, **third}


def train_from(adapter, base):
    """lora_single_device's load: the run's lora node (q/v, rank 8, alpha 16) with lora.adapter_dir."""
    setup_model(resolve_model_source({"checkpoint_dir": str(base)}), device=torch.device("cpu"),
                dtype=torch.float32, lora={**lora_cfg(modules=QV), "adapter_dir": str(adapter)})


def resume_from(adapter, base):
    """A resume's load: the adapter into the live LoRA model."""
    load_peft_adapter(trained_lora_model(base, modules=QV), adapter)


LOADS = {
    "training": train_from,
    "resume": resume_from,
    "generate": lambda adapter, base: lora_node_from_adapter(adapter),
    "merge": lambda adapter, base: read_adapter(adapter),
}

def with_magnitudes(short=None):  # DoRA's magnitudes added, one per lora_B row; the ``short`` lora_B's one short
    return lambda tensors: {**tensors, **{k.replace("lora_B.weight", "lora_magnitude_vector"): torch.ones(
        v.shape[0] - (k == short)) for k, v in tensors.items() if k.endswith("lora_B.weight")}}


# (source adapter, config fields, tensors rewrite, the disagreement the error names)
CONFIG_VS_WEIGHTS = {
    "rank": ("rank16", {"r": 8}, None,
             "adapter_config.json says r=8 but lora_A of layers.0.self_attn.q_proj has 16 rows"),
    "one_module": ("good", None, without("v_proj"),
                   "adapter_config.json lists v_proj in target_modules but this file has no v_proj adapter"),
    "seven_modules": ("seven", {"target_modules": QV}, None,
                      "adapter_config.json's target_modules ['q_proj', 'v_proj'] do not name layers.0.mlp.down_proj, "
                      "but this file has an adapter for it"),
    "absent_module": ("good", {"target_modules": [*QV, "foo_proj"]}, None,
                      "adapter_config.json lists foo_proj in target_modules but this file has no foo_proj adapter"),
    "dora": ("good", {"use_dora": True}, None,
             "adapter_config.json says use_dora=true but layers.0.self_attn.q_proj has no lora_magnitude_vector"),
    "no_lora_B": ("good", None, without("q_proj.lora_B"), "layers.0.self_attn.q_proj has lora_A but no lora_B"),
    # Mutations seen failing (one a case): the lora_B column check skipped; the "matrices" check skipped; the "no
    # tensors" refusal dropped; DoRA's magnitude shape check skipped; magnitudes accepted without use_dora; a target
    # matched by a bare suffix ("proj" naming q_proj, which peft's "whole name or .suffix" rule does not);
    # target_parameters without expert tensors let through; a key that is no LoRA tensor let through.
    "lora_B_rank": ("good", None, lambda t: {k: v[:, :4].contiguous() if k == Q0 + "lora_B.weight" else v
                                             for k, v in t.items()},
                    "adapter_config.json says r=8 but lora_B of layers.0.self_attn.q_proj has 4 columns"),
    "not_matrices": ("good", None, lambda t: {k: v.reshape(8, 16, 16) if k == Q0 + "lora_A.weight" else v
                                              for k, v in t.items()},
                     "lora_A and lora_B of layers.0.self_attn.q_proj must be matrices, not of shapes [8, 16, 16] and "
                     "[256, 8]"),
    "no_tensors": ("good", None, lambda t: {}, "holds no lora_A / lora_B tensors"),
    "magnitude_shape": ("good", {"use_dora": True}, with_magnitudes(short=Q0 + "lora_B.weight"),
                        "lora_magnitude_vector of layers.0.self_attn.q_proj has shape [255] but its lora_B has 256 "
                        "rows"),
    "dora_off": ("good", None, with_magnitudes(),
                 "adapter_config.json says use_dora=false but layers.0.self_attn.q_proj has a lora_magnitude_vector"),
    "suffix_target": ("good", {"target_modules": ["proj"]}, None,
                      "adapter_config.json's target_modules ['proj'] do not name layers.0.self_attn.q_proj, but this "
                      "file has an adapter for it"),
    "expert_targets": ("good", {"target_parameters": ["mlp.experts.down_proj"]}, None,
                       "adapter_config.json lists target_parameters ['mlp.experts.down_proj'] but this file has no "
                       "expert adapters"),
    "not_lora": ("good", None, lambda t: {**t, Q0 + "lora_embedding_A": torch.zeros(8, 4)},
                 f"{Q0}lora_embedding_A is not a LoRA tensor (lora_A, lora_B or lora_magnitude_vector): mtune reads "
                 "LoRA and DoRA adapters only"),
}


@pytest.mark.parametrize("load", LOADS)
@pytest.mark.parametrize("case", CONFIG_VS_WEIGHTS)
def test_a_config_that_does_not_describe_its_weights_is_refused_by_every_load(case, load, made, tmp_path):
    source, config, tensors, problem = CONFIG_VS_WEIGHTS[case]
    adapter = variant(made, tmp_path, source, config, tensors)
    with pytest.raises(AdapterError) as err:
        LOADS[load](adapter, made[1])
    assert str(err.value) == f"{adapter / WEIGHTS}: {problem}"
    assert err.value.hint.startswith("adapter_config.json must be the one saved with these weights")


MODEL_VS_WEIGHTS = {
    "another_base": (for_hidden_128,
                     "lora_A of layers.0.self_attn.q_proj has shape [8, 128] but the model's is [8, 256]"),
    "missing_layer": (without("layers.0.self_attn.q_proj"),
                      "the model adapts layers.0.self_attn.q_proj but the adapter has no lora_A for it"),
    "extra_layer": (with_a_third_layer,
                    "the adapter has lora_A of layers.2.self_attn.q_proj, which the model does not adapt"),
}


@pytest.mark.parametrize("load", ["training", "resume"])
@pytest.mark.parametrize("case", MODEL_VS_WEIGHTS)
def test_an_adapter_that_does_not_fit_the_model_is_refused(case, load, made, tmp_path):
    tensors, problem = MODEL_VS_WEIGHTS[case]
    adapter = variant(made, tmp_path, tensors=tensors)
    with pytest.raises(AdapterError) as err:
        LOADS[load](adapter, made[1])
    assert str(err.value) == f"{adapter / WEIGHTS}: {problem}"
    assert err.value.hint == ("the adapter does not fit this model: set model.checkpoint_dir to the base model it was "
                              f"trained on (adapter_config.json names {made[1]})")


def test_an_adapter_that_does_not_fit_is_refused_before_the_base_weights_load(made, tmp_path, monkeypatch):
    import mtune.training.model_setup as model_setup

    def load_weights(*args, **kwargs):
        raise AssertionError("the base weights were loaded before the adapter was checked")

    monkeypatch.setattr(model_setup, "materialize_model", load_weights)
    with pytest.raises(AdapterError, match="has shape \\[8, 128\\] but the model's is \\[8, 256\\]"):
        train_from(variant(made, tmp_path, tensors=for_hidden_128), made[1])


def test_an_rslora_adapter_is_refused_for_loading_and_merged_with_its_scaling(made, tmp_path):
    adapter = variant(made, tmp_path, config={"use_rslora": True})
    with pytest.raises(AdapterError) as err:
        train_from(adapter, made[1])
    assert str(err.value) == (f"{adapter}: adapter_config.json has use_rslora=true, which mtune's LoRA layers cannot "
                              "load (they scale by alpha/r)")
    assert err.value.hint == "merge it into its base model (mtune run merge_lora) and use the merged model"
    assert read_adapter(adapter).layers["layers.0.self_attn.q_proj"].scaling == 16 / 8 ** 0.5


def test_a_model_directory_that_is_an_adapter_says_so(made):
    adapter = made[0] / "good"
    with pytest.raises(AdapterError) as err:
        read_hf_config(adapter)
    assert str(err.value) == f"checkpoint_dir={adapter} is a PEFT adapter directory (adapter_config.json), not a model"
    assert err.value.hint == (f"set adapter_dir={adapter} and checkpoint_dir to the adapter's base model "
                              f"(adapter_config.json names {made[1]})")
    with pytest.raises(AdapterError) as err:
        resolve_model_source({"checkpoint_dir": str(adapter)})
    assert err.value.hint.startswith(f"set lora.adapter_dir={adapter} and model.checkpoint_dir to the adapter's base")


# adapter_config.json fields mtune cannot represent (peft's LoraConfig has them all) -> the value, and why
UNSUPPORTED = {
    "peft_type": ("LOHA", "only LoRA / DoRA adapters are supported"),
    "target_modules": ("q_proj|v_proj", "must be a list of module names (a regex is not supported)"),
    "rank_pattern": ({"q_proj": 16}, "per-module ranks are not supported"),
    "alpha_pattern": ({"v_proj": 32}, "per-module alphas are not supported"),
    "modules_to_save": (["lm_head"], "fully trained extra modules are not supported"),
    "bias": ("lora_only", "trained biases are not supported (need bias: none)"),
    "fan_in_fan_out": (True, "transposed (Conv1D) weights are not supported"),
    "r": (0, "must be a positive integer"),
    "lora_alpha": ("16", "must be a number"),
}


@pytest.mark.parametrize("value", [True, 8.0], ids=["bool", "float"])
def test_a_rank_that_is_no_int_is_refused(value, made, tmp_path):
    """``r`` must be an int: JSON's ``true`` (a bool, which ``isinstance(.., int)`` accepts) and ``8.0`` are
    refused. Mutation seen failing: ``type(r) is not int`` written as ``not isinstance(r, int)``."""
    adapter = variant(made, tmp_path, config={"r": value})
    with pytest.raises(AdapterError) as err:
        check_adapter(adapter)
    assert str(err.value) == f"{adapter / 'adapter_config.json'}: r={value!r}: must be a positive integer"


@pytest.mark.parametrize("field", UNSUPPORTED)
def test_a_config_mtune_cannot_represent_is_refused_naming_the_field(field, made, tmp_path):
    """Each adapter_config.json setting mtune's LoRA layers cannot represent is refused in one line naming the file,
    the field and its value. Mutations seen failing (one a case): each of the nine checks skipped; ``r < 1`` as
    ``r < 0``."""
    value, why = UNSUPPORTED[field]
    adapter = variant(made, tmp_path, config={field: value})
    with pytest.raises(AdapterError) as err:
        check_adapter(adapter)
    assert str(err.value) == f"{adapter / 'adapter_config.json'}: {field}={value!r}: {why}"


def test_what_peft_writes_beside_a_lora_adapter_is_read(made, tmp_path):
    """What a valid peft adapter may hold besides its factors passes: the experts' ``rank_pattern`` /
    ``alpha_pattern`` key (``gate_up_proj``), and peft's copy of a targeted lm_head's base weight
    (``lm_head.base_layer.weight``); a config without ``lora_alpha`` gets peft's default, ``LoraConfig().lora_alpha``
    (8), and is then refused by a model built with alpha 16. Mutations seen failing: the EXPERT_PATTERN exemption
    dropped from rank_pattern; ``.base_layer.weight`` keys not skipped; the default alpha 16 (in
    read_adapter_config)."""
    import peft

    adapter = variant(made, tmp_path, config={"rank_pattern": {"gate_up_proj": 16},
                                              "alpha_pattern": {"gate_up_proj": 32}},
                      tensors=lambda t: {**t, "base_model.model.lm_head.base_layer.weight": torch.zeros(512, 256)})
    assert check_adapter(adapter) == json.loads((adapter / "adapter_config.json").read_text())
    path = adapter / "adapter_config.json"
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "lora_alpha"}))
    assert lora_node_from_adapter(adapter)["alpha"] == peft.LoraConfig().lora_alpha == 8
    with pytest.raises(AdapterError) as err:
        train_from(adapter, made[1])
    assert str(err.value).startswith(f"{adapter}: adapter_config.json has lora_alpha=8.0 but the model has "
                                     "lora.alpha=16.0: ")


def test_adapter_weights_in_another_format_are_named(made, tmp_path):
    """An adapter saved as ``adapter_model.bin`` (peft's ``safe_serialization=False``) is refused naming the file
    found. Mutation seen failing: the "(found ...)" hint dropped."""
    adapter = variant(made, tmp_path)
    (adapter / WEIGHTS).rename(adapter / "adapter_model.bin")
    with pytest.raises(AdapterError) as err:
        check_adapter(adapter)
    assert str(err.value) == f"{adapter / WEIGHTS}: not found (found adapter_model.bin; only safetensors is read)"


def test_the_models_dropout_is_saved_in_the_adapter_config(made, tmp_path):
    """A model built with lora.dropout 0.1 and saved without a lora node writes ``lora_dropout`` 0.1, which peft's
    ``LoraConfig.from_pretrained`` reads back. Mutation seen failing: lora_layout's dropout always 0.0."""
    import peft

    from mtune.training.checkpointing.adapter_check import lora_layout

    model, _ = setup_model(resolve_model_source({"checkpoint_dir": str(made[1])}), device=torch.device("cpu"),
                           dtype=torch.float32, lora={**lora_cfg(modules=QV), "dropout": 0.1})
    assert lora_layout(model) == dict(modules=QV, rank=8, alpha=16, dropout=0.1, use_dora=False)
    save_peft_adapter(model, tmp_path / "adapter")
    assert peft.LoraConfig.from_pretrained(tmp_path / "adapter").lora_dropout == 0.1


def expert_adapter(tmp_path, target_parameters, rank_pattern, shapes):
    """A hand-written expert adapter directory (r=4, alpha 8, no target_modules): ``shapes`` maps a peft module
    name to its (lora_A, lora_B) shapes; the tensors are zeros."""
    out = tmp_path / "experts"
    out.mkdir(parents=True)
    (out / "adapter_config.json").write_text(json.dumps(dict(
        peft_type="LORA", r=4, lora_alpha=8, target_modules=[], target_parameters=target_parameters,
        rank_pattern=rank_pattern, alpha_pattern={k: 2 * v for k, v in rank_pattern.items()})))
    save_file({f"base_model.model.model.layers.0.mlp.{name}.lora_{part}.weight": torch.zeros(shape)
               for name, (a, b) in shapes.items() for part, shape in (("A", a), ("B", b))}, out / WEIGHTS)
    return out


def test_expert_factors_must_be_the_experts_times_the_rank(tmp_path):
    """Expert adapters (peft's target_parameters): lora_A [E * R, in], lora_B [out, R * E], R the rank_pattern's
    for gate_up_proj (here 8, twice r=4) or r for down_proj. Two experts: gate_up_proj alone at rank 8 (A 16 rows,
    B 16 columns) and both (gate_up nested under ``experts.base_layer``, down_proj at r=4: 8) pass; gate_up_proj
    alone with 12 = 1.5 x 8 is refused naming rank 8 (12 is a multiple of r=4). Mutations seen failing: the
    divisibility check (``a[0] % r``) dropped; a lone gate_up_proj taken for down_proj (rank r)."""
    gate_up = ["mlp.experts.gate_up_proj"]
    ok = expert_adapter(tmp_path / "one", gate_up, {"gate_up_proj": 8}, {"experts": ((16, 8), (12, 16))})
    assert check_adapter(ok)["target_parameters"] == gate_up
    both = expert_adapter(tmp_path / "both", ["mlp.experts.down_proj", *gate_up], {"gate_up_proj": 8},
                          {"experts.base_layer": ((16, 8), (12, 16)), "experts": ((8, 6), (8, 8))})
    assert check_adapter(both)["rank_pattern"] == {"gate_up_proj": 8}
    bad = expert_adapter(tmp_path / "bad", gate_up, {"gate_up_proj": 8}, {"experts": ((12, 8), (12, 12))})
    with pytest.raises(AdapterError) as err:
        check_adapter(bad)
    assert str(err.value) == (f"{bad / WEIGHTS}: adapter_config.json says rank 8 for the experts' gate_up_proj but "
                              "lora_A of layers.0.mlp.experts has 12 rows and lora_B 12 columns (both must be the "
                              "number of experts times the rank)")

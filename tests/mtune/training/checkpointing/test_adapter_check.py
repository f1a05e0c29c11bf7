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

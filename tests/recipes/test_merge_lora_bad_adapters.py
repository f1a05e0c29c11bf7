"""merge_lora refuses an adapter whose adapter_config.json does not describe its weights (it used to merge it
silently, wrongly: another rank's scale, only the modules the weights hold, modules the config does not name), and
an adapter given as the base model, with one line naming the file, and writes nothing."""

import pytest
from omegaconf import OmegaConf

from mtune.training.checkpointing.peft import AdapterError, save_peft_adapter
from recipes import merge_lora
from tests._helpers.lora import trained_lora_model
from tests._helpers.models import write_tiny_hf_model
from tests.mtune.training.checkpointing.test_adapter_check import CONFIG_VS_WEIGHTS, variant

QV = ["q_proj", "v_proj"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    base = write_tiny_hf_model(root, "llama3_1")
    for name, kwargs in {"good": {}, "rank16": dict(rank=16),
                         "seven": dict(modules=[*QV, "k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])}.items():
        save_peft_adapter(trained_lora_model(base, **{"modules": QV, **kwargs}), root / name,
                          base_model_name_or_path=base)
    return root, base


def merge(tmp_path, adapter, **keys):
    cfg = OmegaConf.create({"recipe": "merge_lora", "adapter_dir": str(adapter), "output_dir": str(tmp_path / "out"),
                            **keys})
    merge_lora.SCHEMA.fill_defaults(cfg)
    assert not merge_lora.SCHEMA.check(cfg)
    return merge_lora.main(cfg)


CASES = {name: CONFIG_VS_WEIGHTS[name] for name in ("rank", "one_module", "seven_modules", "absent_module")}


@pytest.mark.parametrize("case", CASES)
def test_an_adapter_whose_config_does_not_describe_its_weights_is_not_merged(case, adapters, tmp_path):
    source, config, tensors, problem = CASES[case]
    adapter = variant(adapters, tmp_path, source, config, tensors)
    with pytest.raises(AdapterError) as err:
        merge(tmp_path, adapter)
    assert str(err.value) == f"{adapter / 'adapter_model.safetensors'}: {problem}"
    assert "lora.modules" not in err.value.hint
    assert not (tmp_path / "out").exists()


def test_an_adapter_given_as_the_base_model_says_where_it_belongs(adapters, tmp_path):
    adapter = adapters[0] / "good"
    with pytest.raises(AdapterError) as err:
        merge(tmp_path, adapter, base_model_dir=str(adapter))
    assert str(err.value) == f"base_model_dir={adapter} is a PEFT adapter directory (adapter_config.json), not a model"
    assert err.value.hint == (f"set adapter_dir={adapter} and base_model_dir to the adapter's base model "
                              f"(adapter_config.json names {adapters[1]})")


@pytest.mark.parametrize("change, problem", [
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     "quantization_config 'fp8' is not supported"),
    ({"model_type": "gpt2"}, "unsupported model_type 'gpt2'"),
])
def test_a_base_model_mtune_cannot_read_is_refused_in_one_line(change, problem, adapters, tmp_path):
    """A base whose config.json mtune does not read is refused naming that file, and nothing is written. Before: an
    fp8-quantized base (weights stored as float8 with scales beside them) merged silently, its codes read as weights
    and the config's quantization_config dropped; an unsupported model_type raised a bare ValueError (traceback)."""
    import json
    import shutil

    from mtune.training.checkpointing.hf import CheckpointError

    base = tmp_path / "base"
    shutil.copytree(adapters[1], base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(CheckpointError) as err:
        merge(tmp_path, adapters[0] / "good", base_model_dir=str(base))
    assert str(err.value).startswith(f"{base / 'config.json'}: {problem}"), str(err.value)
    assert not (tmp_path / "out").exists()

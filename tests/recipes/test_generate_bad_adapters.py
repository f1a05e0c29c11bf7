"""generate with an adapter that does not fit, or with the adapter given as the model: one error line naming the
adapter file and what disagrees, a hint in generate's own keys (adapter_dir, model.checkpoint_dir), no traceback."""

import pytest

from mtune._cli.main import main
from mtune.training.checkpointing.peft import save_peft_adapter
from tests._helpers.lora import trained_lora_model
from tests.mtune.training.checkpointing.test_adapter_check import for_hidden_128, variant, without

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_checkpoint):
    root = tmp_path_factory.mktemp("adapters")
    for name, rank in (("good", 8), ("rank16", 16)):
        save_peft_adapter(trained_lora_model(tiny_checkpoint, modules=["q_proj", "v_proj"], rank=rank), root / name,
                          base_model_name_or_path=tiny_checkpoint)
    return root, tiny_checkpoint


def generate(capsys, checkpoint, *keys):
    code = main(["run", "generate", "--config", "tiny/generate", f"model.checkpoint_dir={checkpoint}",
                 f"tokenizer.path={checkpoint}", "device=cpu", "max_new_tokens=2", *keys])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err and "lora.modules" not in err, err
    return err.splitlines()[-2:]


@pytest.mark.parametrize("case", ["rank", "another_base", "missing_layer"])
def test_an_adapter_that_does_not_fit_is_one_line(case, adapters, tmp_path, capsys):
    source, config, tensors, problem, hint = {
        "rank": ("rank16", {"r": 8}, None, "adapter_config.json says r=8 but lora_A of layers.0.self_attn.q_proj has "
                 "16 rows", "hint: adapter_config.json must be the one saved with these weights"),
        "another_base": ("good", None, for_hidden_128, "lora_A of layers.0.self_attn.q_proj has shape [8, 128] but "
                         "the model's is [8, 256]", "hint: the adapter does not fit this model: set "
                         "model.checkpoint_dir to the base model it was trained on"),
        "missing_layer": ("good", None, without("layers.0.self_attn.q_proj"), "the model adapts "
                          "layers.0.self_attn.q_proj but the adapter has no lora_A for it", "hint: the adapter does "
                          "not fit this model: set model.checkpoint_dir to the base model it was trained on"),
    }[case]
    adapter = variant(adapters, tmp_path, source, config, tensors)
    error, said = generate(capsys, adapters[1], f"adapter_dir={adapter}")
    assert error == f"error: {adapter / WEIGHTS}: {problem}"
    assert said.startswith(hint)


def test_an_adapter_given_as_the_model_says_where_it_belongs(adapters, capsys):
    adapter = adapters[0] / "good"
    assert generate(capsys, adapter, "~adapter_dir") == [
        f"error: model.checkpoint_dir={adapter} is a PEFT adapter directory (adapter_config.json), not a model",
        f"hint: set adapter_dir={adapter} and model.checkpoint_dir to the adapter's base model (adapter_config.json "
        f"names {adapters[1]})",
    ]

"""Hugging Face checkpoints: transformers writes and reads the oracle side of every check."""

import json

import pytest
import torch
from safetensors import safe_open

from mtune.training.checkpointing.hf import (
    CheckpointError, load_hf_checkpoint, load_hf_config, load_model_from_hf, save_hf_checkpoint,
)
from mtune.models import build_model
from mtune.units import SizeError
from tests._helpers.models import FAMILY_CONFIGS, write_tiny_hf_model

transformers = pytest.importorskip("transformers")
TOKENS = torch.randint(0, 512, (2, 100), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    dirs = {}
    for i, family in enumerate(FAMILY_CONFIGS):
        path = write_tiny_hf_model(root, family, sharded=i % 2 == 0)
        (path / "tokenizer_config.json").write_text('{"model_max_length": 512}')
        dirs[family] = path
    return dirs


def hf_logits(path):
    with torch.no_grad():
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(TOKENS).logits


def tensors(path):
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out.update((k, f.get_tensor(k)) for k in f.keys())
    return out


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_load_matches_transformers_and_round_trips(family, hf_dirs, tmp_path):
    src = hf_dirs[family]
    model = load_model_from_hf(src).eval()
    assert model.embed_tokens.weight.dtype == torch.float32
    with torch.no_grad():
        ours = model(TOKENS)
    reference = hf_logits(src)
    assert (ours - reference).abs().max().item() <= 1e-5  # 100 tokens: past Llama 3.1's original 64

    out = save_hf_checkpoint(model, tmp_path / "out", source_dir=src, max_shard_size="600KB")
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 512}'
    assert (out / "generation_config.json").is_file()
    saved, original = tensors(out), tensors(src)
    assert saved.keys() == original.keys()
    assert all(torch.equal(saved[k], original[k]) for k in saved)
    assert ("lm_head.weight" in saved) == (not model.args.tie_embeddings)
    config = json.loads((out / "config.json").read_text())
    assert config == json.loads((src / "config.json").read_text())  # fields and names kept, dtype still float32
    assert torch.equal(hf_logits(out), reference)


def test_save_from_iterator_in_bf16_then_load_back(hf_dirs, tmp_path):
    src = hf_dirs["llama3_2"]
    model = load_model_from_hf(src, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.embed_tokens.weight
    out = save_hf_checkpoint(((n, t) for n, t in model.state_dict().items()), tmp_path / "bf16", source_dir=src)
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert hf.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(hf.model.layers[1].mlp.down_proj.weight, model.layers[1].mlp.down_proj.weight)


def test_save_without_source_uses_model_args(tmp_path):
    torch.manual_seed(0)
    model = build_model("qwen2_5", "tiny", device="cpu").eval()
    out = save_hf_checkpoint(model, tmp_path / "fresh")
    with torch.no_grad():
        assert (hf_logits(out) - model(TOKENS)).abs().max().item() <= 1e-5


def test_load_into_materialised_model_and_legacy_config(hf_dirs, tmp_path):
    src = hf_dirs["llama3_1"]
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    for f in src.iterdir():
        (legacy / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "config.json").read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = {**params, "type": params.pop("rope_type")}  # transformers 4.3x layout
    config["torch_dtype"] = config.pop("dtype")
    del config["head_dim"]
    (legacy / "config.json").write_text(json.dumps(config))
    assert load_hf_config(legacy) == load_hf_config(src)
    model = build_model("llama3_1", "tiny", device="cpu")
    load_hf_checkpoint(model, legacy)
    with torch.no_grad():
        assert (model(TOKENS) - hf_logits(src)).abs().max().item() <= 1e-5
    out = save_hf_checkpoint(model, tmp_path / "out", source_dir=legacy)
    saved = json.loads((out / "config.json").read_text())
    assert saved["torch_dtype"] == "float32" and "dtype" not in saved


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_bad_inputs_name_the_file_or_key(hf_dirs, tmp_path):
    sharded, single = hf_dirs["llama2"], hf_dirs["llama3_1"]
    assert (sharded / "model.safetensors.index.json").exists() and (single / "model.safetensors").exists()

    d = _copy(single, tmp_path / "gpt2")
    (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), "model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match=r"config\.json: unsupported model_type 'gpt2'"):
        load_hf_config(d)

    d = _copy(sharded, tmp_path / "missing_shard")
    shard = sorted(d.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"{shard.name}: shard listed in model\.safetensors\.index\.json is missing"):
        load_model_from_hf(d)

    d = _copy(single, tmp_path / "shape")
    (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), "intermediate_size": 256}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor model\.layers\.\d\.mlp\.\w+_proj\.weight has shape"):
        load_model_from_hf(d)

    d = _copy(single, tmp_path / "truncated")
    blob = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(CheckpointError, match=r"truncated/model\.safetensors: unreadable safetensors file"):
        load_model_from_hf(d)

    d = _copy(single, tmp_path / "keys")
    (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), "num_hidden_layers": 3}))
    with pytest.raises(CheckpointError, match=r"missing keys \[layers\.2\..*\], unexpected keys \[\]"):
        load_model_from_hf(d)

    with pytest.raises(CheckpointError, match="already holds model weights"):
        save_hf_checkpoint({}, single, source_dir=single)


def test_max_shard_size_that_is_not_a_size(hf_dirs, tmp_path):
    src = next(iter(hf_dirs.values()))
    with pytest.raises(SizeError, match=r"^max_shard_size '5XB' is not a size; write e.g. 5GB, 500MB or a number "
                                        r"of bytes$"):
        save_hf_checkpoint({}, tmp_path / "out", source_dir=src, max_shard_size="5XB")


def test_a_checkpoint_with_more_layers_than_the_model_is_refused(hf_dirs, tmp_path):
    """Keys the model has no place for are named, not skipped."""
    d = _copy(hf_dirs["llama3_1"], tmp_path / "extra")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config["num_hidden_layers"] - 1}))
    last = config["num_hidden_layers"] - 1
    with pytest.raises(CheckpointError, match=rf"missing keys \[\], unexpected keys \[layers\.{last}\."):
        load_model_from_hf(d)


def test_shards_hold_one_tensor_each_past_the_limit_and_the_index_counts_their_bytes(hf_dirs, tmp_path):
    """Read back with safetensors: a tensor larger than max_shard_size gets a shard of its own (no empty shard
    before it); the index's total_size is the tensors' bytes. A dequantized save drops quantization_config."""
    src = _copy(hf_dirs["llama3_1"], tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    weights = {"model.norm.weight": torch.ones(64), "lm_head.weight": torch.zeros(512, 64, dtype=torch.bfloat16)}
    out = save_hf_checkpoint(weights, tmp_path / "out", source_dir=src, max_shard_size=100)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index == {"metadata": {"total_size": 64 * 4 + 512 * 64 * 2},
                     "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors",
                                    "model.norm.weight": "model-00001-of-00002.safetensors"}}
    for name, key in (("model-00001-of-00002.safetensors", "model.norm.weight"),
                      ("model-00002-of-00002.safetensors", "lm_head.weight")):
        with safe_open(str(out / name), "pt") as f:
            assert list(f.keys()) == [key] and torch.equal(f.get_tensor(key), weights[key])
    assert "quantization_config" not in json.loads((out / "config.json").read_text())

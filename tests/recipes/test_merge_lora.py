"""The merge_lora recipe: in-process and through the real CLI, bit-equal to the library's streaming merge."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open

from mtune.training.checkpointing.hf import ShardWriter  # the writer save_merged_model streams shards through
from mtune.training.checkpointing.merge import merged_hf_weights
from mtune.training.checkpointing.peft import save_peft_adapter
from recipes import merge_lora
from tests._helpers.lora import trained_lora_model
from tests._helpers.models import write_tiny_hf_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    base = write_tiny_hf_model(root, "llama3_1")
    model = trained_lora_model(base, use_dora=True, modules=["q_proj", "v_proj", "down_proj", "lm_head"])
    save_peft_adapter(model, root / "final", base_model_name_or_path=base)
    return root, base, model


def read_tensors(path):
    out = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out.update((k, f.get_tensor(k)) for k in f.keys())
    return out


def assert_same(saved, expected):
    assert saved.keys() == expected.keys()
    for key in expected:
        assert saved[key].dtype == expected[key].dtype and torch.equal(saved[key], expected[key]), key


def test_in_process_equals_live_merge(run_dir, tmp_path):
    root, base, model = run_dir
    # The base comes from the adapter's base_model_name_or_path: no base_model_dir needed.
    cfg = OmegaConf.create({"recipe": "merge_lora", "adapter_dir": str(root / "final"),
                            "output_dir": str(tmp_path / "merged"), "max_shard_size": "400KB"})
    merge_lora.SCHEMA.fill_defaults(cfg)
    assert not merge_lora.SCHEMA.check(cfg)
    out = merge_lora.main(cfg)
    assert len(list(out.glob("model-*.safetensors"))) > 1 and (out / "config.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp_")]
    assert_same(read_tensors(out), dict(merged_hf_weights(base, model)))

    with pytest.raises(FileExistsError, match="already exists and is not empty"):
        merge_lora.main(cfg)
    (tmp_path / "a_file").write_text("")  # an empty file is named as a file, not as a non-empty directory
    with pytest.raises(FileExistsError, match=r"a_file is a file: choose another output_dir or remove it$"):
        merge_lora.main(OmegaConf.merge(cfg, {"output_dir": str(tmp_path / "a_file")}))


def test_cli_run_bf16(run_dir, tmp_path):
    root, base, model = run_dir
    config = tmp_path / "merge.yaml"
    config.write_text(f"recipe: merge_lora\nadapter_dir: {root / 'final'}\nbase_model_dir: {base}\n"
                      f"output_dir: {tmp_path / 'merged'}\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "MTUNE_DEBUG": "0"}
    result = subprocess.run([sys.executable, "-m", "mtune", "run", str(REPO / "recipes" / "merge_lora.py"),
                             "--config", str(config), "dtype=bf16"], env=env, cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert_same(read_tensors(tmp_path / "merged"), dict(merged_hf_weights(base, model, dtype=torch.bfloat16)))


def test_a_merge_that_fails_midway_leaves_no_output(run_dir, tmp_path, monkeypatch):
    root, base, model = run_dir
    cfg = OmegaConf.create({"recipe": "merge_lora", "adapter_dir": str(root / "final"),
                            "output_dir": str(tmp_path / "merged"), "max_shard_size": "400KB"})
    merge_lora.SCHEMA.fill_defaults(cfg)
    add = ShardWriter.add

    def add_until_a_shard_is_written(writer, key, tensor):
        if writer.shards:  # one shard is on disk: the output is half written
            raise OSError(28, "No space left on device")
        add(writer, key, tensor)

    monkeypatch.setattr(ShardWriter, "add", add_until_a_shard_is_written)
    with pytest.raises(OSError, match="No space left on device"):
        merge_lora.main(cfg)
    assert list(tmp_path.iterdir()) == []  # neither output_dir nor its temporary directory

    monkeypatch.setattr(ShardWriter, "add", add)
    out = merge_lora.main(cfg)
    assert out == tmp_path / "merged" and [p.name for p in tmp_path.iterdir()] == ["merged"]
    assert_same(read_tensors(out), dict(merged_hf_weights(base, model)))

"""``mtune plan`` of a Qwen3.5 (Gated DeltaNet) run: the scan over chunks (`mtune.modules.gated_delta_scan`) runs two
chunks on fake tensors whatever the length, and the plan is the one the whole loop gives, and the one real tensors
give, byte for byte."""

import pytest

from mtune._cli.catalog import find_recipe, load_recipe_module
from mtune._cli.run import load_and_check
from mtune.modules import gated_delta_scan
from mtune.training.planning.plan import plan_memory
from tests._helpers.models import write_tiny_hf_model
from tests._helpers.recipes import TRAIN_CONFIG, count_planned, train_overrides, write_instruct_data
from tests._helpers.tokenizers import write_tokenizer_files


@pytest.fixture(scope="module")
def qwen3_5_config(tmp_path_factory):
    """A tiny Qwen3.5 (three DeltaNet layers and a full-attention one) on packed rows of 640 tokens: 10 chunks of
    64 per row, checkpointed blocks (the scan runs again in backward)."""
    tmp = tmp_path_factory.mktemp("qwen3_5_plan")
    vocab = write_tokenizer_files(tmp / "tok", "qwen3_5")
    path = write_tiny_hf_model(tmp, "qwen3_5", vocab_size=vocab, bos_token_id=None, eos_token_id=vocab - 3)
    write_tokenizer_files(path, "qwen3_5")
    overrides = train_overrides(tmp, path, write_instruct_data(tmp / "train.jsonl"), **{
        "tokenizer.path": str(path), "dataset.packed": True, "tokenizer.max_seq_len": 640, "batch_size": 2,
        "enable_activation_checkpointing": True})
    return load_and_check(load_recipe_module(find_recipe("lora_single_device")), TRAIN_CONFIG, overrides)


def _figures(plan):
    return plan.device, plan.host, plan.at_peak, plan.device_peak_bytes, plan.host_peak_bytes


def test_two_chunks_plan_what_every_chunk_plans(qwen3_5_config, monkeypatch):
    """Mutation seen failing: each chunk's delta kept for backward (both tests: the fake loop keeps two)."""
    ran = count_planned(monkeypatch, gated_delta_scan, "planned_chunks")
    short = plan_memory(qwen3_5_config)
    assert ran and max(ran) == 2
    monkeypatch.setattr(gated_delta_scan, "planned_chunks", lambda n, like: range(n))
    assert _figures(short) == _figures(plan_memory(qwen3_5_config))


def test_the_plan_is_what_real_tensors_hold(qwen3_5_config):
    """The same two steps on real tensors (every chunk computed) hold the planned bytes exactly, on rows of one
    document each (packed, the real rows' segment boundaries, a few int32 per document, are counted from the data:
    16 bytes apart here, the planner's fake rows cannot tell where documents end)."""
    cfg = qwen3_5_config.copy()
    cfg.dataset.packed = False
    assert _figures(plan_memory(cfg)) == _figures(plan_memory(cfg, fake=False))

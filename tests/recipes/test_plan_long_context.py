"""Long context on fake tensors (``mtune plan``): the planned peak of the tiny LoRA config with packed rows grows
linearly in the row length from 4K to 32K tokens, with and without the tiled MLP, while the dense mask (the
fallback kernel) does not; and no tensor of a step at 32K tokens has O(s²) elements (rotary tables included)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mtune._cli.catalog import find_recipe, load_recipe_module
from mtune._cli.run import load_and_check
from mtune.models import build_model
from tests._helpers.training import apply_memory_techniques
from mtune.training.memory.registry import MemoryConfig
from mtune.training.planning.plan import plan_memory
from tests._helpers.recipes import TRAIN_CONFIG, train_overrides
from tests._helpers.training import LargestTensor

LENGTHS = (4096, 8192, 16384, 32768)
TOLERANCE = 0.02
"""Linear: each doubling of s adds twice the previous increment, within 2% (measured: exactly 2.000)."""


def _peaks(tmp_path, checkpoint, data, lengths, **changes):
    module = load_recipe_module(find_recipe("lora_single_device"))
    peaks = []
    for s in lengths:
        overrides = train_overrides(tmp_path, checkpoint, data, **{
            "dataset.packed": True, "batch_size": 1, "tokenizer.max_seq_len": s, **changes})
        peaks.append(plan_memory(load_and_check(module, TRAIN_CONFIG, overrides)).device_peak_bytes)
    return [b - a for a, b in zip(peaks, peaks[1:])]


@pytest.mark.parametrize("changes", [{}, {"mlp_tiles": "auto"}, {"enable_activation_checkpointing": True}])
def test_planned_peak_grows_linearly_in_the_row_length(tmp_path, tiny_checkpoint, tiny_data, changes):
    steps = _peaks(tmp_path, tiny_checkpoint, tiny_data, LENGTHS, **changes)
    for before, after in zip(steps, steps[1:]):
        assert after == pytest.approx(2 * before, rel=TOLERANCE), steps


def test_the_dense_mask_does_not(tmp_path, tiny_checkpoint, tiny_data):
    # the oracle that the check above can see an s² term: the fallback's [1, 1, s, s] mask
    steps = _peaks(tmp_path, tiny_checkpoint, tiny_data, LENGTHS[:3], attention_kernel="dense_mask")
    assert steps[1] > 2 * (1 + TOLERANCE) * steps[0], steps



@pytest.mark.parametrize("family, changes", [("llama3_1", {}),
                                             ("mistral", {"sliding_window": 2048})])  # a window besides documents
def test_no_tensor_of_s_squared_elements_at_32k(family, changes):
    s = 32768
    model = build_model(family, "tiny", device="meta", **changes)
    apply_memory_techniques(model, MemoryConfig(mlp_tiles="auto"), lora={"modules": ["q_proj", "v_proj"]})
    model.to_empty(device="cpu")
    vocab, dim = model.args.vocab_size, model.args.dim
    with FakeTensorMode(allow_non_fake_inputs=True):
        tokens = torch.randint(0, vocab, (1, s))
        ids = (torch.arange(s) // 5000)[None]  # documents of 5,000 tokens, the last one shorter
        pos = (torch.arange(s) % 5000)[None]
        cos, sin = model.rope(pos, torch.float32)
        assert cos.shape == sin.shape == (1, s, model.args.head_dim)  # rotary tables sized by the row
        with LargestTensor() as seen:
            model(tokens, input_pos=pos, document_ids=ids).float().sum().backward()
    assert seen.largest <= s * max(vocab, 4 * dim)  # the logits; s² would be 1.07e9

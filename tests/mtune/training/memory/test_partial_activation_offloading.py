"""``activation_offloading_blocks: N``: only the first N blocks' checkpointed inputs go to the host, the rest stay
on the device; the losses and gradients are those of offloading every block, and the bytes moved are N blocks'
inputs plus what is saved outside the blocks (an independent count: batch x seq x dim x 4 bytes per block)."""

import pytest
import torch

from mtune.models import build_model
from mtune.training.memory.registry import MemoryConfig
from mtune.training.memory.techniques.activation_checkpointing.checkpoint import apply_activation_checkpointing
from mtune.training.memory.techniques.activation_offloading import ACTIVATION_OFFLOADING
from mtune.training.memory.techniques.activation_offloading.offload import apply_activation_offloading
from mtune.training.memory.technique import ModelFacts
from mtune.training.placement import Placement
from tests._helpers.training import assert_identical, loss_and_grads

gen = torch.Generator().manual_seed(3)
TOKENS = torch.randint(0, 512, (2, 64), generator=gen)
LABELS = torch.randint(0, 512, (2, 64), generator=gen)
N_LAYERS, DIM = 4, 256
BLOCK_INPUT = 2 * 64 * DIM * 4  # one block's input, fp32


def _offloaded(blocks):
    torch.manual_seed(0)
    model = apply_activation_checkpointing(build_model("llama3_1", "tiny", device="cpu", n_layers=N_LAYERS))
    ctx = apply_activation_offloading(model, use_streams=False, min_offload_bytes=BLOCK_INPUT, blocks=blocks,
                                      placement=Placement("cpu", distinct=True))  # every move a real copy
    # (tensors under one block input, the rotary tables, stay: the count below is of block inputs)
    return model, ctx


def test_the_first_blocks_offload_and_the_numbers_are_those_of_offloading_all():
    """Mutation checked: ignoring ``blocks`` in `apply_activation_offloading` (every block offloads) fails the
    byte counts."""
    every_model, every = _offloaded(None)
    expected = loss_and_grads(every_model, TOKENS, LABELS, every, seed=1)
    outside = every.offloaded_bytes - N_LAYERS * BLOCK_INPUT  # saved outside the blocks (the loss's inputs)
    assert outside >= 0
    for blocks in (0, 1, 3):
        model, ctx = _offloaded(blocks)
        assert_identical(loss_and_grads(model, TOKENS, LABELS, ctx, seed=1), expected)
        assert ctx.offloaded_bytes == outside + blocks * BLOCK_INPUT, blocks


@pytest.mark.parametrize("blocks", [None, 0, 2])
def test_the_model_offloads_exactly_the_block_inputs_and_not_its_head(blocks):
    """Guards the final norm and lm_head keeping their saved tensors in place: inside the model only the offloading
    blocks' inputs go out."""
    model, ctx = _offloaded(blocks)
    with ctx:
        out = model(TOKENS).sum()  # no loss: nothing outside the model is saved
    out.backward()
    assert ctx.offloaded_bytes == (N_LAYERS if blocks is None else blocks) * BLOCK_INPUT


def test_the_configured_blocks_reach_the_model():
    """Guards the technique's on_model passing ``activation_offloading_blocks`` on (not offloading every block)."""
    from tests._helpers.training import apply_memory_techniques

    torch.manual_seed(0)
    model = build_model("llama3_1", "tiny", device="cpu", n_layers=3)
    memory = MemoryConfig(enable_activation_checkpointing=True, enable_activation_offloading=True,
                          activation_offloading_use_streams=False, activation_offloading_blocks=1)
    ctx = apply_memory_techniques(model, memory, placement=Placement("cpu", distinct=True))
    tokens = torch.randint(0, 512, (2, 512), generator=torch.Generator().manual_seed(1))
    with ctx:
        out = model(tokens).sum()
    out.backward()
    assert ctx.offloaded_bytes == 2 * 512 * DIM * 4  # block 0's input (1 MiB: at the default threshold), only


def test_the_key_is_validated_and_priced_by_its_blocks():
    settings = ACTIVATION_OFFLOADING.Settings
    on = dict(enable_activation_checkpointing=True, enable_activation_offloading=True)
    memory = MemoryConfig(**on, activation_offloading_blocks=3)
    assert ACTIVATION_OFFLOADING.rules(memory[ACTIVATION_OFFLOADING], memory) == []
    off = MemoryConfig(enable_activation_checkpointing=True, activation_offloading_blocks=3)
    [problem] = ACTIVATION_OFFLOADING.rules(off[ACTIVATION_OFFLOADING], off)
    assert problem.startswith("activation_offloading_blocks=3 needs enable_activation_offloading=true")
    [key] = [k for k in settings.keys() if k.name == "activation_offloading_blocks"]
    assert key.default is None and key.check(-1, key.name) and not key.check(0, key.name)
    facts = ModelFacts(n_layers=32, dim=4096, trainable_bytes=0, frozen_bytes=0, residual_bytes=2,
                       micro_batch_tokens=1, step_tokens=1, cuda=True, trainable_numel=0, world_size=1)
    per_block = 2.0 * 4096 * 2  # out in forward, back in backward, bf16
    for blocks, moved in ((None, 32), (8, 8), (40, 32), (0, 0)):
        s = MemoryConfig(**on, activation_offloading_blocks=blocks)
        footprint = ACTIVATION_OFFLOADING.footprint(s[ACTIVATION_OFFLOADING], s, facts)
        assert (footprint.transfer_bytes_per_token or 0) == pytest.approx(moved * per_block), blocks

"""FLOPs of the long-context paths against torch's FlopCounterMode on a real step (the oracle): the tiled MLP's
recompute (one more MLP forward per token, and a whole MLP in a checkpointed block's recompute) and packed rows
under the segments kernel (each document against itself: sum of L² over documents, not s² per row)."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from mtune.models import build_model
from mtune.modules.lora import apply_lora
from mtune.modules.tiled_mlp import apply_tiled_mlp
from mtune.training.memory.techniques.activation_checkpointing.checkpoint import apply_activation_checkpointing
from mtune.training.memory.registry import MemoryConfig
from mtune.training.observe.flops import StepFlops, mean_document_length

TINY = dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, intermediate_dim=256, vocab_size=512,
            tie_embeddings=False)


def _packed(lengths, s):
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    assert ids.shape[1] == s
    return ids, pos


class OpFlops(TorchDispatchMode):
    """FlopCounterMode's per-op formulas without its module tracker (whose hooks on module inputs fail inside an
    autograd Function's forward, where the tiled MLP calls LoRA's submodules)."""

    total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func._overloadpacket in flop_registry:
            self.total += flop_registry[func._overloadpacket](*args, **kwargs, out_val=out)
        return out


def _counted(model, batch, memory=None):
    """FLOPs of one forward + backward as FlopCounterMode's formulas count them, and StepFlops' (model,
    hardware) for a run of ``memory``'s techniques."""
    with sdpa_kernel(SDPBackend.MATH), OpFlops() as counter:
        out = model(batch["tokens"], input_pos=batch.get("input_pos"), document_ids=batch.get("document_ids"))
        out.float().square().mean().backward()
    return counter.total, StepFlops(model, memory=memory)([batch])


@pytest.mark.parametrize("tiles, checkpointed, lora", [(4, False, False), ("auto", True, True)])
def test_tiled_mlp_recompute_is_counted(tiles, checkpointed, lora):
    torch.manual_seed(0)
    model = build_model("llama3_2", "tiny", device="cpu", **TINY)
    if lora:
        apply_lora(model, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], rank=4,
                   alpha=8)
    apply_tiled_mlp(model, tiles)  # auto: 2 x 96 tokens on width 128: 2 tiles
    if checkpointed:
        apply_activation_checkpointing(model)
    batch = {"tokens": torch.randint(0, 512, (2, 96))}
    counted, (model_flops, hardware_flops) = _counted(
        model, batch, MemoryConfig(mlp_tiles=tiles, enable_activation_checkpointing=checkpointed))
    assert hardware_flops == counted
    untiled = StepFlops(apply_tiled_mlp(model, 1), memory=MemoryConfig(enable_activation_checkpointing=checkpointed))(
        [batch])
    assert model_flops == untiled[0] and hardware_flops > untiled[1]  # MFU unchanged, HFU counts the recompute


@pytest.mark.parametrize("kernel", ["segments", "dense_mask"])
def test_packed_rows_count_attention_per_document(kernel):
    torch.manual_seed(0)
    model = build_model("llama3_2", "tiny", device="cpu", **TINY)
    model.attention_kernel = kernel
    lengths, s = [100, 37, 180, 3], 320
    ids, pos = _packed(lengths, s)
    batch = {"tokens": torch.randint(0, 512, (1, s)), "input_pos": pos, "document_ids": ids}
    counted, (model_flops, hardware_flops) = _counted(model, batch)
    assert model_flops == hardware_flops == counted
    assert mean_document_length(ids) == sum(n * n for n in lengths) / s
    unpacked = StepFlops(model)([{"tokens": batch["tokens"]}])[0]
    assert (model_flops < unpacked) == (kernel == "segments")  # the dense mask computes the whole row


def test_auto_kernel_counts_the_whole_row_up_to_256_tokens():
    """``attention_kernel=auto`` keeps the dense mask for rows of at most 256 tokens (the model's own rule), so a
    packed row of exactly 256 computes its full square: StepFlops equals the counted step. Mutation seen failing:
    ``seq_len >= DENSE_MASK_UP_TO`` (the row counted per document, as under the segments kernel)."""
    torch.manual_seed(0)
    model = build_model("llama3_2", "tiny", device="cpu", **{**TINY, "n_layers": 1})
    model.attention_kernel = "auto"
    ids, pos = _packed([100, 156], 256)
    batch = {"tokens": torch.randint(0, 512, (1, 256)), "input_pos": pos, "document_ids": ids}
    counted, (model_flops, hardware_flops) = _counted(model, batch)
    assert model_flops == hardware_flops == counted


def test_step_flops_count_tokens_before_padding():
    """A micro-batch's FLOPs are its non-padding tokens (``num_tokens``) times the FLOPs per token at its padded
    length: 100 of 2 x 64 positions count 100/128 of the padded batch's. Mutation seen failing: ``num_tokens``
    ignored (every position counted)."""
    model = build_model("llama3_2", "tiny", **TINY)  # on meta
    tokens = torch.zeros(2, 64, dtype=torch.long)
    step = StepFlops(model)
    padded = step([{"tokens": tokens}])
    assert step([{"tokens": tokens, "num_tokens": 100}]) == (padded[0] * 100 / 128, padded[1] * 100 / 128)

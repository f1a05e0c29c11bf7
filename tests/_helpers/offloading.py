"""A tiny model and its weight-offloaded twin holding the same weights, and the batch the weight-offloading tests
compare the two on (forward, backward, bit for bit)."""

import copy

import torch

from mtune.models import build_model
from mtune.training.memory.registry import MemoryConfig
from mtune.training.memory.techniques.weight_offloading.offloader import weight_offloader
from mtune.training.placement import Placement
from tests._helpers.training import apply_memory_techniques, loss_and_grads

_gen = torch.Generator().manual_seed(7)
TOKENS = torch.randint(0, 512, (2, 32), generator=_gen)
LABELS = torch.randint(0, 512, (2, 32), generator=_gen)
LORA = {"modules": ["q_proj", "v_proj", "down_proj"], "rank": 4, "alpha": 8}
N_LAYERS = 4


def offloaded_pair(memory: MemoryConfig, lora=LORA, dtype=torch.float32, n_layers=N_LAYERS):
    """(plain model, offloaded twin with the same weights, its offloader), both with ``memory``'s other techniques."""
    torch.manual_seed(0)
    base = build_model("llama3_1", "tiny", device="cpu", n_layers=n_layers, dtype=dtype)
    plain, twin = copy.deepcopy(base), copy.deepcopy(base)
    plain_memory = memory.replace(weight_offloading=None)
    apply_memory_techniques(plain, plain_memory, lora=lora)
    ctx = apply_memory_techniques(twin, memory, lora=lora, placement=Placement("cpu", distinct=True))
    twin.load_state_dict(plain.state_dict())
    offloader = weight_offloader(twin)
    offloader.offload()
    return plain, twin, offloader, ctx


def offloaded_loss_and_grads(model, ctx=None):
    """:func:`loss_and_grads` on :data:`TOKENS` -> :data:`LABELS`."""
    return loss_and_grads(model, TOKENS, LABELS, ctx)

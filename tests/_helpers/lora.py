"""LoRA models for the adapter tests: a ``lora`` node, and a model whose adapters look trained (for export, merge
and generation checks against peft)."""

import torch

from mtune.training.model_setup import resolve_model_source, setup_model

ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def lora_cfg(use_dora=False, quantize_base=False, modules=ALL_LINEARS, rank=8, alpha=16) -> dict:
    """A ``lora`` node: ``modules`` at ``rank`` / ``alpha``, no dropout."""
    return dict(modules=list(modules), rank=rank, alpha=alpha, dropout=0.0, use_dora=use_dora,
                quantize_base=quantize_base)


def trained_lora_model(base_dir, seed=1, **kwargs):
    """A LoRA model on the base checkpoint whose adapters look trained: B non-zero, magnitudes moved off ||W||."""
    torch.manual_seed(seed)  # the A matrices' init
    model, _ = setup_model(resolve_model_source({"checkpoint_dir": str(base_dir)}), device=torch.device("cpu"),
                           dtype=torch.float32, lora=lora_cfg(**kwargs))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_b.weight"):
                param.copy_(0.05 * torch.randn(param.shape, generator=gen))
            elif name.endswith("magnitude"):
                param.mul_(1 + 0.1 * torch.randn(param.shape, generator=gen))
    return model.eval()

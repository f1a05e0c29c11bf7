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


def lora_steps(checkpoint_dir, lora: dict, steps: int = 8) -> tuple[torch.nn.Module, list[float]]:
    """A LoRA (QLoRA in bf16 when ``lora["quantize_base"]``) model on ``checkpoint_dir`` trained ``steps`` AdamW
    steps (lr 3e-3) on one seeded batch of 4 x 24 tokens; returns the model and each step's loss."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if lora["quantize_base"] else torch.float32
    model, _ = setup_model(resolve_model_source({"checkpoint_dir": str(checkpoint_dir)}), device=torch.device("cpu"),
                           dtype=dtype, lora=lora)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    tokens = torch.randint(0, 512, (4, 24), generator=torch.Generator().manual_seed(7))
    losses = []
    for _ in range(steps):
        out = model(tokens[:, :-1]).float()
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, losses


def assert_peft_loads_the_adapter(model, lora: dict, checkpoint_dir, out_dir, tokens, atol: float = 1e-5) -> None:
    """Save ``model``'s adapter in PEFT format into ``out_dir`` and load it with peft on transformers' model of
    ``checkpoint_dir``: its logits of ``tokens`` equal mtune's within ``atol``."""
    import peft

    from mtune.training.checkpointing.peft import save_peft_adapter
    from tests._helpers.models import load_hf_model, logits_of

    save_peft_adapter(model.eval(), out_dir, lora)
    adapted = peft.PeftModel.from_pretrained(load_hf_model(checkpoint_dir), out_dir).eval()
    assert (logits_of(adapted, tokens) - logits_of(model, tokens)).abs().max().item() <= atol

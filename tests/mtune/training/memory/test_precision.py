"""Precision: dtype resolution, and fp16 autocast with dynamic loss scaling against an fp32 run."""

import pytest
import torch

from mtune.models import build_model
from mtune.modules.loss import CrossEntropyLoss
from mtune.training.precision import LossScaler, autocast, resolve_dtype, storage_dtype

gen = torch.Generator().manual_seed(9)
TOKENS = torch.randint(0, 512, (2, 32), generator=gen)
LABELS = torch.roll(TOKENS, -1, dims=1)  # learnable: predict the next token of a fixed batch


def _train(dtype_name, steps=8):
    torch.manual_seed(0)
    model = build_model("llama3_1", "tiny", device="cpu", dtype=storage_dtype(dtype_name), n_layers=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = LossScaler(dtype_name, "cpu")
    losses = []
    for _ in range(steps):
        with autocast(dtype_name, "cpu"):
            logits = model(TOKENS)
        loss_sum, n = CrossEntropyLoss()(logits, LABELS)
        loss = loss_sum / n
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        assert scaler.step(opt)
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses, logits.dtype


def test_fp16_with_loss_scaling_trains_like_fp32():
    model, fp16, logits_dtype = _train("fp16")
    _, fp32, _ = _train("fp32")
    assert logits_dtype == torch.float16 and next(model.parameters()).dtype == torch.float32
    assert fp16[-1] < 0.5 * fp16[0]
    # Measured: fp32 6.347 -> 0.3982 in 8 steps, fp16 0.3988 (0.15% off).
    assert abs(fp16[-1] - fp32[-1]) <= 0.01 * fp32[-1]


def test_step_with_inf_gradient_is_skipped_and_reported():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    scaler = LossScaler("fp16", "cpu", init_scale=1024.0)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(torch.randn(2, 4)).sum()).backward()
    model.weight.grad[0, 0] = float("inf")
    assert scaler.step(opt) is False
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert scaler.skipped_steps == 1 and scaler.get_scale() == 512.0
    assert scaler.state_dict()["scale"] == 512.0
    restored = LossScaler("fp16", "cpu")
    restored.load_state_dict(scaler.state_dict())
    assert restored.get_scale() == 512.0


def test_resolve_dtype(monkeypatch):
    assert resolve_dtype("bf16", "cpu") == torch.bfloat16 and resolve_dtype("fp16", "cpu") == torch.float16
    assert storage_dtype("fp16") == torch.float32 and storage_dtype("bf16") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype='float8' is not supported: use one of"):
        resolve_dtype("float8", "cpu")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    with pytest.raises(ValueError, match="Tesla T4 has no bf16 support: set dtype=fp16"):
        resolve_dtype("bf16", "cuda")

"""plan_check's tracker costs nothing once its tracked steps are over: its gradient hooks go with the last one."""

import torch

from mtune.training.memory.registry import MemoryConfig
from mtune.models import model_args
from mtune.modules.loss import CrossEntropyLoss
from mtune.training.loop import train_step
from mtune.training.planning.breakdown import MemoryBreakdown
from mtune.training.optimizers import build_optimizer, inner_optimizers
from mtune.training.planning.tracker import TensorTracker
from mtune.training.model_setup import ModelSource, setup_model

LORA = dict(modules=["q_proj", "v_proj"], rank=4, alpha=8, dropout=0.0, use_dora=False, quantize_base=False)


def test_gradient_hooks_are_removed_after_the_tracked_steps(tmp_path, monkeypatch):
    calls = []
    on_grad = TensorTracker._on_grad

    def counted(self, param):
        calls.append(param)
        on_grad(self, param)

    monkeypatch.setattr(TensorTracker, "_on_grad", counted)
    torch.manual_seed(0)
    source = ModelSource("tiny", model_args("tiny", "tiny"), None)
    model, _ = setup_model(source, device=torch.device("cpu"), dtype=torch.float32, lora=LORA, memory=MemoryConfig())
    optimizer = build_optimizer({"_component_": "torch.optim.AdamW", "lr": 1e-3}, model)
    breakdown = MemoryBreakdown(model, inner_optimizers(optimizer), tmp_path, num_steps=2, write=False,
                                track_all_steps=False)
    batch = {"tokens": torch.randint(0, 512, (2, 16)), "labels": torch.randint(0, 512, (2, 16))}
    trainable = sum(p.requires_grad for p in model.parameters())
    per_step = []
    for _ in range(4):
        before = len(calls)
        with breakdown.track_step():
            train_step(model, [batch], CrossEntropyLoss(), optimizer, device=torch.device("cpu"))
        per_step.append(len(calls) - before)
    assert per_step == [trainable, trainable, 0, 0]
    assert breakdown.tracked_steps == 2 and breakdown.overall.category_peak["device"]["gradients"] > 0


def test_every_step_keeps_its_hooks_when_every_step_is_tracked(tmp_path):
    source = ModelSource("tiny", model_args("tiny", "tiny"), None)
    model, _ = setup_model(source, device=torch.device("cpu"), dtype=torch.float32, lora=LORA, memory=MemoryConfig())
    optimizer = build_optimizer({"_component_": "torch.optim.AdamW", "lr": 1e-3}, model)
    breakdown = MemoryBreakdown(model, inner_optimizers(optimizer), tmp_path, num_steps=1, write=False)
    batch = {"tokens": torch.randint(0, 512, (2, 16)), "labels": torch.randint(0, 512, (2, 16))}
    for _ in range(2):
        with breakdown.track_step():
            train_step(model, [batch], CrossEntropyLoss(), optimizer, device=torch.device("cpu"))
    assert breakdown.tracked_steps == 2 and len(breakdown.tracker._hooks) == sum(
        p.requires_grad for p in model.parameters())

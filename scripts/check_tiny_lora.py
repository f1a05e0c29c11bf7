"""Check that a LoRA fine-tune of the shipped tiny model learns the chat-format word reversal in a few minutes.

Measures greedy exact-match accuracy on ``eval.jsonl`` before and after a LoRA fine-tune on ``train.jsonl`` (a
minimal hand-written LoRA, so this check depends only on the model, tokenizer and data layers). Run from the
repository root::

    python scripts/check_tiny_lora.py --steps 200
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtune.assets import tiny_data_dir, tiny_model_dir  # noqa: E402
from mtune.data import IGNORE_INDEX, collate_padded, instruct_dataset  # noqa: E402
from mtune.tokenizers import load_tokenizer  # noqa: E402
from mtune.training.checkpointing.hf import load_model_from_hf  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tiny_model import chat_reversal_accuracy  # noqa: E402


class LoRALinear(nn.Module):
    """``base(x) + (alpha / rank) * B(A(x))`` with ``B`` starting at zero."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base, self.scale = base, alpha / rank
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) / math.sqrt(base.in_features))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x):
        return self.base(x) + self.scale * (x @ self.lora_a.T @ self.lora_b.T)


def add_lora(model, modules: list[str], rank: int, alpha: float) -> None:
    model.requires_grad_(False)
    for block in model.layers:
        for parent in (block.self_attn, block.mlp):
            for name in modules:
                if isinstance(getattr(parent, name, None), nn.Linear):
                    setattr(parent, name, LoRALinear(getattr(parent, name), rank, alpha))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--modules", default="q_proj,k_proj,v_proj,o_proj")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(args.seed)

    tokenizer = load_tokenizer(tiny_model_dir())
    model = load_model_from_hf(tiny_model_dir(), dtype=torch.float32).eval()
    eval_rows = [json.loads(line) for line in open(tiny_data_dir() / "eval.jsonl")]
    before = chat_reversal_accuracy(model, tokenizer, eval_rows)
    print(f"base accuracy (chat format): {before:.0%}", flush=True)

    add_lora(model, args.modules.split(","), args.rank, 2 * args.rank)
    params = [p for p in model.parameters() if p.requires_grad]
    print(f"trainable parameters: {sum(p.numel() for p in params):,}")
    data = instruct_dataset(tokenizer, str(tiny_data_dir() / "train.jsonl"), cache=False)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    order, start, step, first = torch.randperm(len(data), generator=gen).tolist(), time.time(), 0, None
    model.train()
    while step < args.steps:
        for i in range(0, len(order) - args.batch_size + 1, args.batch_size):
            batch = collate_padded([data[j] for j in order[i:i + args.batch_size]], tokenizer.pad_id)
            logits = model(batch["tokens"])
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            for g in opt.param_groups:  # linear decay to 0
                g["lr"] = args.lr * (1 - step / args.steps)
            opt.step()
            step += 1
            first = first if first is not None else loss.item()
            if step % 25 == 0 or step == 1:
                print(f"step {step:4d}  loss {loss.item():.4f}  {time.time() - start:5.0f}s", flush=True)
            if step == args.steps:
                break
        order = torch.randperm(len(data), generator=gen).tolist()
    train_s = time.time() - start
    model.eval()
    after = chat_reversal_accuracy(model, tokenizer, eval_rows)
    print(f"fine-tune: {args.steps} steps x {args.batch_size}, loss {first:.3f} -> {loss.item():.3f}, "
          f"{train_s:.0f}s; accuracy {before:.0%} -> {after:.0%}")


if __name__ == "__main__":
    main()

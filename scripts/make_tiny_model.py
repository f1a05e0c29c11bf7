"""Build mtune's shipped tiny model, its tokenizer and the word-reversal task data (``mtune/assets/tiny``).

Everything comes from seeds: the corpus (:func:`mtune.data.word_reversal.pretraining_corpus`), a byte-level BPE
trained on it and converted to a Llama 3 tiktoken rank file, a Llama 3 architecture pretrained on it from random
weights, and the instruction splits. Run from the repository root::

    python scripts/make_tiny_model.py --out mtune/assets/tiny

Each pretraining run takes 10-25 minutes on a CPU (see docs/tiny_model.md for the figures of the shipped files). On the same
torch build and thread count the run repeats exactly.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from mtune.data.word_reversal import (
    PROMPT_TEMPLATE, WORDS, chat_warmup_example, make_task_split, pretraining_corpus, sample_word_list,
)
from mtune.models import build_model_from_args, model_args
from mtune.modules.generation import generate
from mtune.tokenizers import Message, load_tokenizer
from mtune.tokenizers.bpe_to_tiktoken import train_byte_level_bpe, write_tiktoken_file
from mtune.tokenizers.llama3 import CHAT_TEMPLATE, PATTERN, special_tokens
from mtune.training.checkpointing.hf import load_model_from_hf, save_hf_checkpoint

BASE_VOCAB = 512


def tiny_model_args():
    """Llama 3.2's tiny shape (tied embeddings, llama3 RoPE scaling) with 4 layers and a 768-token vocabulary."""
    return model_args("llama3_2", "tiny", vocab_size=BASE_VOCAB + 256, n_layers=4, max_seq_len=256)


def tokenizer_text(corpus: list[str]) -> list[str]:
    """The corpus plus the chat prompt and every word with and without a leading space (so that each task word is
    one token wherever it stands), and numbers as low-frequency filler that fills the 512 ranks."""
    words = [" ".join(WORDS) + "\n" + "\n".join(WORDS)] * 1000
    return corpus + [PROMPT_TEMPLATE.format(words="") + " system user assistant"] * 1000 + words + [
        " ".join(str(i) for i in range(1000))]


def write_tokenizer(corpus: list[str], model_dir: Path) -> None:
    """tokenizer.model (tiktoken ranks), tokenizer.json (the same BPE for transformers) and tokenizer_config.json."""
    spec = json.loads(train_byte_level_bpe(tokenizer_text(corpus), BASE_VOCAB, PATTERN))
    write_tiktoken_file(spec, model_dir / "tokenizer.model")
    spec["added_tokens"] = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True} for t, i in sorted(special_tokens(BASE_VOCAB).items(), key=lambda kv: kv[1])
    ]
    (model_dir / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
        "pad_token": "<|finetune_right_pad_id|>", "model_max_length": 256, "chat_template": CHAT_TEMPLATE,
    }, indent=2) + "\n")


def packed_batches(token_stream: list[int], seq_len: int, batch_size: int, seed: int):
    """Endless shuffled batches ``[batch_size, seq_len + 1]`` cut from the concatenated documents."""
    n = (len(token_stream) - 1) // seq_len
    data = torch.tensor(token_stream[: n * seq_len + 1])
    gen = torch.Generator().manual_seed(seed)
    while True:
        for idx in torch.randperm(n, generator=gen).split(batch_size):
            if len(idx) == batch_size:
                yield torch.stack([data[i * seq_len: (i + 1) * seq_len + 1] for i in idx.tolist()])


@torch.no_grad()
def plain_reversal_accuracy(model, tokenizer, seed: int, n: int = 100) -> float:
    """Exact-match accuracy of greedy ``reverse: a b c =>`` completions (the corpus's own format)."""
    rng, hits = random.Random(seed), 0
    for _ in range(n):
        words = sample_word_list(rng)
        ids = tokenizer.encode(f"reverse: {' '.join(words)} =>", add_eos=False)
        out = generate(model, ids, max_new_tokens=12, stop_tokens=[tokenizer.eos_id])[0, len(ids):].tolist()
        hits += tokenizer.decode(out).strip() == " ".join(reversed(words))
    return hits / n


@torch.no_grad()
def chat_reversal_accuracy(model, tokenizer, rows: list[dict]) -> float:
    """Exact-match accuracy of greedy answers to ``rows`` rendered in the Llama 3 chat format."""
    hits = 0
    for row in rows:
        ids = tokenizer.tokenize_messages([Message("user", row["instruction"])], add_generation_prompt=True).tokens
        out = generate(model, ids, max_new_tokens=16, stop_tokens=tokenizer.stop_tokens)[0, len(ids):].tolist()
        hits += tokenizer.decode(out).strip() == row["output"]
    return hits / len(rows)


def training_tokens(corpus: list[str], tokenizer, chat_fraction: float, seed: int) -> list[int]:
    """The corpus lines (each ``<|begin_of_text|> line <|end_of_text|>``) mixed in a seeded random order with
    :func:`chat_warmup_example` conversations rendered in the chat format, which make up ``chat_fraction`` of the
    documents (each conversation ends at the assistant's ``<|eot_id|>``)."""
    docs = [tokenizer.encode(line) for line in corpus]
    rng = random.Random(seed)
    n_chat = round(len(corpus) * chat_fraction / (1 - chat_fraction))
    for _ in range(n_chat):
        row = chat_warmup_example(rng)
        docs.append(tokenizer.tokenize_messages(
            [Message("user", row["instruction"]), Message("assistant", row["output"])]).tokens)
    if n_chat:
        rng.shuffle(docs)
    return [t for doc in docs for t in doc]


def pretrain(model, tokens: list[int], steps: int, seed: int, batch_size: int = 16, seq_len: int = 128,
             lr: float = 3e-3, warmup: int = 50, log_every: int = 50) -> list[tuple[int, float]]:
    """Next-token training with AdamW, linear warmup and cosine decay to lr/10; returns (step, mean loss) logs."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, s / steps)))))
    batches, logs, running, start = packed_batches(tokens, seq_len, batch_size, seed), [], 0.0, time.time()
    model.train()
    for step in range(1, steps + 1):
        batch = next(batches)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        running += loss.item()
        if step % log_every == 0:
            logs.append((step, running / log_every))
            print(f"step {step:5d}  loss {running / log_every:.4f}  {time.time() - start:6.0f}s", flush=True)
            running = 0.0
    model.eval()
    return logs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("mtune/assets/tiny"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus-lines", type=int, default=200_000)
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--init-from", type=Path, default=None,
                        help="continue from this model directory's weights (a previous run) instead of random ones")
    parser.add_argument("--chat-fraction", type=float, default=0.0,
                        help="share of documents that are chat-format warm-up conversations (not reversal)")
    parser.add_argument("--task-words", type=int, nargs=2, default=(3, 3), metavar=("MIN", "MAX"),
                        help="words per task sample in train/eval.jsonl")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--train-rows", type=int, default=2000)
    parser.add_argument("--eval-rows", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    model_dir, data_dir = args.out / "model", args.out / "data"
    for d in (model_dir, data_dir):
        shutil.rmtree(d, ignore_errors=True)
    tmp_dir = args.out / "model.tmp"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)

    corpus = pretraining_corpus(args.seed, args.corpus_lines)
    write_tokenizer(corpus, tmp_dir)
    (tmp_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
    tokenizer = load_tokenizer(tmp_dir)
    tokens = training_tokens(corpus, tokenizer, args.chat_fraction, args.seed + 4)
    print(f"corpus: {len(corpus)} lines, chat fraction {args.chat_fraction}, {len(tokens)} tokens", flush=True)

    margs = tiny_model_args()
    if args.init_from is not None:
        if (args.init_from / "tokenizer.model").read_bytes() != (tmp_dir / "tokenizer.model").read_bytes():
            raise SystemExit(f"{args.init_from}: its tokenizer differs from this seed's; use the same --seed")
        model = load_model_from_hf(args.init_from, dtype=torch.float32)
    else:
        model = build_model_from_args(margs, device="cpu")
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters", flush=True)
    start = time.time()
    # A continued run walks the corpus in a new order rather than repeating the first run's.
    logs = pretrain(model, tokens, args.steps, args.seed + (args.init_from is not None), lr=args.lr)
    minutes = (time.time() - start) / 60

    eval_rows = make_task_split(args.seed + 1, args.eval_rows, None, *args.task_words)
    train_rows = make_task_split(args.seed + 2, args.train_rows, {r["instruction"] for r in eval_rows},
                                 *args.task_words)
    data_dir.mkdir(parents=True)
    for name, rows in (("train", train_rows), ("eval", eval_rows)):
        with open(data_dir / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)

    save_hf_checkpoint({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, model_dir, model_args=margs)
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json"):
        shutil.move(str(tmp_dir / name), model_dir / name)
    shutil.rmtree(tmp_dir)
    (model_dir / "model.safetensors").chmod(0o644)
    config = json.loads((model_dir / "config.json").read_text())
    stops = [tokenizer.eos_id, tokenizer.eom_id, tokenizer.eot_id]
    config.update(bos_token_id=tokenizer.bos_id, eos_token_id=stops, pad_token_id=tokenizer.pad_id)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (model_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tokenizer.bos_id, "eos_token_id": stops, "pad_token_id": tokenizer.pad_id,
         "do_sample": False}, indent=2) + "\n")

    plain = plain_reversal_accuracy(model, tokenizer, seed=args.seed + 3)
    warmup_rows = [chat_warmup_example(random.Random(args.seed + 5 + i)) for i in range(100)]
    print(f"chat warm-up tasks (fp32 weights): {chat_reversal_accuracy(model, tokenizer, warmup_rows):.0%}")
    chat = chat_reversal_accuracy(model, tokenizer, eval_rows)
    print(f"pretraining: {args.steps} steps in {minutes:.1f} min, final loss {logs[-1][1]:.4f}")
    print(f"accuracy (fp32 weights): plain format {plain:.0%}, chat format on eval.jsonl {chat:.0%}")


if __name__ == "__main__":
    main()

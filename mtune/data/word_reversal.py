"""The built-in synthetic task: reverse a short list of words.

mtune's tiny default model is pretrained on a corpus that shows word reversal in plain text ("reverse: a b c => c b
a"), and its default fine-tune teaches the same skill in the model's chat format. Answers can be checked exactly, so
a run can report exact-match accuracy before and after fine-tuning.

Everything here is pure Python and seeded: the same seed always gives the same corpus and the same samples.
"""

from __future__ import annotations

import random

WORDS = (
    "apple bird cloud door egg fish gold hill ink jar kite lamp moon nest oak pear queen rain salt tree "
    "umbrella vase wolf yarn zebra bread chair dust fire glass horse iron juice king leaf milk night ocean "
    "paper quilt rock snow tiger violin water box yellow zinc stone river green blue red black white sun"
).split()

PROMPT_TEMPLATE = "Reverse the words: {words}"


def sample_word_list(rng: random.Random, min_words: int = 3, max_words: int = 5) -> list[str]:
    """``min_words`` to ``max_words`` distinct words drawn from :data:`WORDS`."""
    return rng.sample(WORDS, rng.randint(min_words, max_words))


def reversal_example(rng: random.Random, min_words: int = 3, max_words: int = 3) -> dict[str, str]:
    """One chat-style sample: ``{"instruction": "Reverse the words: a b c", "output": "c b a"}``."""
    words = sample_word_list(rng, min_words, max_words)
    return {"instruction": PROMPT_TEMPLATE.format(words=" ".join(words)), "output": " ".join(reversed(words))}


def make_task_split(seed: int, n: int, exclude: set[str] | None = None, min_words: int = 3,
                    max_words: int = 3) -> list[dict[str, str]]:
    """``n`` distinct reversal samples of ``min_words`` to ``max_words`` words (the shipped splits: 3); prompts in ``exclude`` (another
    split's) are never drawn."""
    rng = random.Random(seed)
    exclude = set(exclude or ())
    rows: list[dict[str, str]] = []
    seen = set(exclude)
    while len(rows) < n:
        row = reversal_example(rng, min_words, max_words)
        if row["instruction"] not in seen:
            seen.add(row["instruction"])
            rows.append(row)
    return rows


def pretraining_corpus(seed: int, n_lines: int) -> list[str]:
    """Plain-text lines for pretraining: reversal shown in several phrasings, plus filler sentences.

    The chat format never appears here, so the base model cannot answer in it until it is fine-tuned.
    """
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = sample_word_list(rng, 2, 6)
        fwd, bwd = " ".join(words), " ".join(reversed(words))
        kind = rng.random()
        if kind < 0.45:
            lines.append(f"reverse: {fwd} => {bwd}")
        elif kind < 0.7:
            lines.append(f"the words {fwd} backwards are {bwd}.")
        elif kind < 0.85:
            lines.append(f"{fwd} reversed is {bwd}.")
        else:
            a, b, c = rng.sample(WORDS, 3)
            lines.append(f"the {a} is near the {b} and the {c}.")
    return lines


def chat_warmup_example(rng: random.Random) -> dict[str, str]:
    """One chat-format sample of a task that is *not* reversal but uses its parts: copy the list, name its first or
    last word, or name the word before / after a given one (``{"instruction": ..., "output": ...}``).

    Continued pretraining on these trains the chat special tokens and the answer position (an answer's first word
    has no leading space, unlike the prompt's words) and reading words out of the prompt by content, so that a short
    fine-tune only has to teach the order of the answer.
    """
    words = sample_word_list(rng, 2, 6)
    fwd = " ".join(words)
    kind = rng.random()
    if kind < 0.3:
        return {"instruction": f"Repeat the words: {fwd}", "output": fwd}
    if kind < 0.45:
        return {"instruction": f"What is the first word: {fwd}", "output": words[0]}
    if kind < 0.6:
        return {"instruction": f"What is the last word: {fwd}", "output": words[-1]}
    i = rng.randrange(1, len(words))
    if kind < 0.85:
        return {"instruction": f"Which word comes before {words[i]}: {fwd}", "output": words[i - 1]}
    return {"instruction": f"Which word comes after {words[i - 1]}: {fwd}", "output": words[i]}



def preference_pair(row: dict[str, str], rng: random.Random) -> dict[str, str]:
    """The task as a preference pair: ``{"prompt", "chosen": the reversal, "rejected": a wrong answer}``, the wrong
    answer being the words in their given order or the reversal with two neighbouring words swapped."""
    words = row["output"].split()
    wrong = list(reversed(words))
    if rng.random() >= 0.5:
        i = rng.randrange(len(words) - 1)
        wrong = words[:i] + [words[i + 1], words[i]] + words[i + 2:]
    return {"prompt": row["instruction"], "chosen": row["output"], "rejected": " ".join(wrong)}


def preference_split(rows: list[dict[str, str]], seed: int) -> list[dict[str, str]]:
    """:func:`preference_pair` of every task row (the shipped ``preference_{train,eval}.jsonl`` come from the
    ``train.jsonl`` / ``eval.jsonl`` rows, so no held-out prompt is trained on)."""
    rng = random.Random(seed)
    return [preference_pair(row, rng) for row in rows]

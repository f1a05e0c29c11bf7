"""Task metrics computed by generating answers: exact-match accuracy on prompt/answer pairs.

A recipe's ``task_eval`` node names one; the recipe calls it before training and after, so a run reports how much
fine-tuning changed the task score, e.g.::

    task_eval:
      _component_: mtune.training.task_eval.ExactMatchEval
      source: ${mtune_asset:tiny/data/eval.jsonl}
      max_samples: 100
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from mtune.data.common import DataError
from mtune.data.sources import load_source
from mtune.modules.generation import generate
from mtune.tokenizers.base import Message
from mtune.training.memory.oom import oom_guard
from mtune.training.signals import GracefulStop, StopDuringEvaluation

__all__ = ["ExactMatchEval", "run_task_eval", "results_before"]

log = logging.getLogger(__name__)


class ExactMatchEval:
    """Greedy-generate an answer to each prompt (rendered in the model's chat format) and count the answers equal
    to the reference after stripping surrounding whitespace.

    Args:
        source: a JSON / JSONL / Parquet / CSV file with a prompt and an answer column.
        prompt_column, answer_column: the columns to read (default ``instruction`` / ``output``).
        system_prompt: an optional system message before each prompt.
        max_samples: evaluate only the first N rows (null: all).
        max_new_tokens: generation budget per answer.
    """

    def __init__(self, source: str, prompt_column: str = "instruction", answer_column: str = "output",
                 system_prompt: str | None = None, max_samples: int | None = None, max_new_tokens: int = 32):
        rows = []
        for row in load_source(source).read():
            missing = [c for c in (prompt_column, answer_column) if c not in row.data]
            if missing:
                raise DataError(f"{row.where}: task_eval needs column {missing[0]!r}; the row has {sorted(row.data)}")
            rows.append(row.data)
        if not rows:
            raise DataError(f"task_eval.source={source}: no rows")
        self.rows = rows[:max_samples] if max_samples else rows
        self.prompt_column, self.answer_column = prompt_column, answer_column
        self.system_prompt, self.max_new_tokens = system_prompt, max_new_tokens
        self.source = str(Path(source))

    @torch.no_grad()
    def __call__(self, model: nn.Module, tokenizer) -> dict:
        """``{"exact_match": accuracy in [0, 1], "num_samples": N, "examples": first 3 (prompt, answer, reference)}``."""
        was_training = model.training
        model.eval()
        correct, examples = 0, []
        try:
            for row in self.rows:
                messages = [Message("user", str(row[self.prompt_column]))]
                if self.system_prompt:
                    messages.insert(0, Message("system", self.system_prompt))
                prompt = tokenizer.tokenize_messages(messages, add_generation_prompt=True).tokens
                out = generate(model, prompt, self.max_new_tokens, stop_tokens=tokenizer.stop_tokens)
                answer = tokenizer.decode(out[0, len(prompt):].tolist()).strip()
                reference = str(row[self.answer_column]).strip()
                correct += answer == reference
                if len(examples) < 3:
                    examples.append({"prompt": row[self.prompt_column], "answer": answer, "reference": reference})
        finally:
            model.train(was_training)
        n = len(self.rows)
        return {"exact_match": correct / max(n, 1), "num_samples": n, "examples": examples}


def run_task_eval(task_eval, model: nn.Module, tokenizer, *, when: str, monitor, cfg, stop: GracefulStop) -> dict | None:
    """``task_eval(model, tokenizer)`` ``when`` (``before`` or ``after``) training, with its progress and result
    lines on ``monitor`` (the session's) and two of its examples; its scores, or None when a stop signal dropped it
    (:meth:`GracefulStop.interrupting`)."""
    what = f"task eval {when} training"
    try:
        with stop.interrupting(what), monitor.activity(what) as activity:  # droppable once shown
            with oom_guard("task evaluation", cfg):
                scores = task_eval(model, tokenizer)
    except StopDuringEvaluation:
        monitor.write(f"{what}: stopped by a signal, no scores")
        return None
    summary = scores.get("summary") or f"exact_match {scores['exact_match']:.1%}"
    monitor.write(f"{what}: {summary} on {scores['num_samples']} samples ({activity.seconds:.1f} s)")
    for example in scores.get("examples", [])[:2]:
        monitor.write(f"  {example['prompt']!r} -> {example['answer']!r} (expected {example['reference']!r})")
    return scores


def results_before(checkpoint) -> dict:
    """``{"task_eval_before": scores}`` from the ``results.json`` of the run that wrote ``checkpoint`` (beside it), for
    a resumed run, which does not evaluate before training again and would otherwise write its results without
    them; empty when that run wrote none (it was killed before its end)."""
    path = Path(checkpoint).parent / "results.json"
    try:
        before = json.loads(path.read_text()).get("task_eval_before") if path.is_file() else None
    except (OSError, ValueError, AttributeError) as err:
        log.warning("%s: unreadable (%s): this run's results.json will not hold the task eval before training",
                    path, err)
        before = None
    return {} if before is None else {"task_eval_before": before}

"""A run's data: the tokenizer, the training and held-out loaders from the config, and the step plan they make (how
many optimizer steps per epoch, how many epochs, how many samples per step)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from mtune.config import ConfigError, instantiate
from mtune.config.keys import accumulation_steps, samples_per_step
from mtune.config.validate import warmup_problem
from mtune.data import DataError, build_dataloader
from mtune.tokenizers import Tokenizer, load_tokenizer

__all__ = ["StepPlan", "setup_data", "setup_tokenizer"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepPlan:
    """How many optimizer steps a run makes. A step is one optimizer step over ``gradient_accumulation_steps``
    micro-batches of ``batch_size`` samples on each of ``world_size`` ranks."""

    steps_per_epoch: int
    epochs: int
    samples_per_step: int
    cut_short: bool = False
    """``max_steps_per_epoch`` stops each epoch before its data runs out (a deliberately short run)."""

    @property
    def total_steps(self) -> int:
        return self.steps_per_epoch * self.epochs

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], batches_per_epoch: int, world_size: int = 1) -> "StepPlan":
        accumulation = accumulation_steps(cfg)
        steps = batches_per_epoch // accumulation
        if steps == 0:
            raise ValueError(f"an epoch has {batches_per_epoch} batches per rank, fewer than "
                             f"gradient_accumulation_steps={accumulation}: lower it or batch_size, or add data")
        cut_short = bool(cfg.get("max_steps_per_epoch")) and int(cfg["max_steps_per_epoch"]) < steps
        if cut_short:
            steps = int(cfg["max_steps_per_epoch"])
        return cls(steps, int(cfg.get("epochs") or 1), samples_per_step(cfg) * world_size, cut_short)

    def check_warmup(self, warmup: Any, warn: bool = True) -> None:
        """When the LR schedule's ``num_warmup_steps`` does not fit in this plan's steps: raises, or only warns when
        ``max_steps_per_epoch`` cut the run short on purpose (a smoke run of a real config); ``warn`` false on all
        ranks but one, so that the warning is printed once."""
        problem = warmup_problem(warmup, self.total_steps, f"{self.steps_per_epoch} steps per epoch x {self.epochs} "
                                 "epochs")
        if problem and self.cut_short:
            if warn:
                log.warning("%s (max_steps_per_epoch cut this run short: it runs, all of it in warmup)", problem)
        elif problem:
            raise ConfigError(problem)


def setup_tokenizer(node: Mapping[str, Any] | None, source: Any) -> Tokenizer:
    """The tokenizer of the config's ``tokenizer`` node (``path``, ``max_seq_len``, ``options``; None: all unset)
    for the model ``source`` (``model_setup.resolve_model_source``'s: ``family``, ``args``, ``checkpoint_dir``):
    ``path``, else the model's ``checkpoint_dir``, with the family's ``options`` (gpt-oss's ``reasoning_effort``...).
    Neither path (random weights, no ``tokenizer.path``): `load_tokenizer`'s one-line error naming
    ``tokenizer.path``. A tokenizer of another family than the model's (``DecoderArgs.tokenizer_families``: a Llama 2
    tokenizer for a Llama 3 model trains, on the wrong ids), or with more ids than the model has embedding rows, is
    refused in one line naming both (higher ids would end the first forward in an index error)."""
    node = node or {}
    options = node.get("options") or {}
    options = OmegaConf.to_container(options) if isinstance(options, DictConfig) else dict(options)
    path = node.get("path") or source.checkpoint_dir
    tokenizer = load_tokenizer(path, max_seq_len=node.get("max_seq_len"), **options)
    readable = source.args.tokenizer_families
    if readable and source.family != "tiny" and tokenizer.family not in readable:  # tiny: tests pair it with each
        raise ConfigError(f"tokenizer.path={path}: a {tokenizer.family} tokenizer, but the model is {source.family}, "
                          f"trained on {' or '.join(readable)} token ids; use the tokenizer the model was trained with "
                          "(null: the one in model.checkpoint_dir)")
    rows = source.args.vocab_size
    if tokenizer.vocab_size > rows:
        model = (f"vocab_size in model.checkpoint_dir={source.checkpoint_dir}'s config.json" if source.checkpoint_dir
                 else f"{source.family} with random weights")
        raise ConfigError(f"tokenizer.path={path}: {tokenizer.vocab_size:,} token ids, more than the {rows:,} rows of "
                          f"the model's embedding ({model}); use the tokenizer the model was trained with"
                          + (", or mend config.json if its vocab_size is not the weights'" if source.checkpoint_dir
                             else ""))
    return tokenizer


def setup_data(cfg, tokenizer, rank: int = 0, world_size: int = 1):
    """``(train_loader, val_loader or None, plan)`` from the config's ``dataset`` / ``dataset_val`` nodes."""
    train_loader = build_dataloader(_dataset(cfg, "dataset", tokenizer), cfg.batch_size, seed=cfg.seed,
                                    rank=rank, world_size=world_size)
    val_loader = None
    if cfg.get("dataset_val") is not None:
        val_loader = build_dataloader(_dataset(cfg, "dataset_val", tokenizer), cfg.batch_size,
                                      seed=cfg.seed, shuffle=False, rank=rank, world_size=world_size,
                                      drop_last=False)
    return train_loader, val_loader, StepPlan.from_config(cfg, len(train_loader), world_size)


def _dataset(cfg, key: str, tokenizer):
    """The data set of the config node ``key``; a data error names the node first (``dataset_val: source=...``),
    since both nodes may name files alike."""
    try:
        return instantiate(cfg[key], tokenizer=tokenizer)
    except DataError as err:
        raise DataError(f"{key}: {err}", err.hint) from None

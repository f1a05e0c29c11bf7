"""The reference model of a preference recipe (``reference: adapters_off | precomputed | copy``), the objective the
training loop runs, and the held-out reward accuracy.

- ``adapters_off``: the policy itself with its LoRA adapters disabled (`mtune.modules.lora.adapters_disabled`): no
  second copy of any weight, one more forward (no gradient) per step;
- ``precomputed``: before training, one pass of the starting model over the training pairs (and the held-out ones)
  writes their reference log-probs to a cache (`mtune.training.reference_cache`); training then holds no reference
  model and runs no reference forward;
- ``copy``: a frozen copy of the starting checkpoint beside the policy (sharded like it in a distributed run).

In a distributed run every rank computes the precompute pass over every pair, in step (FSDP2's forward gathers
weights from all ranks), and rank 0 writes the cache.

The reference is always the model the run starts from, without adapters: the base checkpoint. In the model's dtype
the three give the same log-probs, so the same losses; the choice moves memory and time only.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from mtune.config import instantiate
from mtune.config.keys import reference_choice
from mtune.data import build_dataloader
from mtune.modules.lora import adapters_disabled
from mtune.modules.preference_loss import PreferenceObjective, pair_logps
from mtune.training.context import RunContext
from mtune.training.loop import evaluate
from mtune.training.memory.registry import MemoryConfig, reference_copy_memory
from mtune.training.model_setup import ModelSource, setup_model, setup_sharded_model
from mtune.training.reference_cache import cached_reference_logps, model_fingerprint

__all__ = ["ModelReference", "PrecomputedReference", "PreferenceEval", "setup_preference"]

log = logging.getLogger(__name__)


class ModelReference:
    """``reference(batch) -> (chosen [b], rejected [b])``: summed response log-probs (fp32) of a pair batch from
    ``model`` under ``context()`` (adapters disabled, or none) and ``autocast()``, without gradient."""

    def __init__(self, model: nn.Module, context: Callable = contextlib.nullcontext,
                 autocast: Callable = contextlib.nullcontext):
        self.model, self.context, self.autocast = model, context, autocast

    @torch.no_grad()
    def __call__(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        with self.context(), self.autocast():
            logits = self.model(batch["tokens"], input_pos=batch.get("input_pos"),
                                document_ids=batch.get("document_ids"), longest_document=batch.get("longest_document"))
        logps, _ = pair_logps(logits, batch)
        n = logps.shape[0] // 2
        return logps[:n], logps[n:]


class PrecomputedReference:
    """``reference(batch)`` looked up by ``batch["pair_index"]`` in the table of its dataset
    (``batch["pairs_of"]``, the dataset's fingerprint): ``{fingerprint: fp32 [pairs, 2]}``."""

    def __init__(self, tables: dict[str, torch.Tensor]):
        self.tables = tables

    def __call__(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        table = self.tables.get(batch.get("pairs_of"))
        if table is None:
            raise RuntimeError("reference=precomputed: these pairs were not in the precomputed pass (only the "
                               "training and held-out sets are)")
        rows = table[batch["pair_index"].cpu()].to(batch["tokens"].device)
        return rows[:, 0], rows[:, 1]


class PreferenceEval:
    """The held-out preference metrics (``dataset_val``) before and after training, as the session's task metric:
    ``reward_accuracy`` (the share of pairs whose chosen response gets the larger implicit reward), the loss and
    the mean rewards and margins."""

    def __init__(self, objective: PreferenceObjective, loader, run: RunContext):
        self.objective, self.loader, self.run = objective, loader, run

    def __call__(self, model: nn.Module, tokenizer) -> dict[str, Any]:
        self.loader.set_epoch(0)
        metrics: dict[str, float] = {}
        loss = evaluate(model, self.loader, self.objective, device=self.run.device, autocast=self.run.autocast,
                        metrics=metrics)
        pairs = getattr(self.loader.dataset, "pairs", self.loader.dataset)  # packed rows: their pairs
        scores = {"reward_accuracy": metrics["rewards/accuracies"], "loss": loss, **metrics,
                  "num_samples": len(pairs)}
        scores["summary"] = (f"held-out reward accuracy {scores['reward_accuracy']:.1%}, margin "
                             f"{metrics['rewards/margins']:.3f}, loss {loss:.4f}")
        return scores


def setup_preference(cfg, run: RunContext, *, model: nn.Module, source: ModelSource, tokenizer, data,
                     memory: MemoryConfig):
    """``(objective, held-out eval or None)``: the config's preference loss (``loss``) with the reference model
    ``reference`` asks for, built (``copy``) or computed and cached (``precomputed``) now, before a resumed run
    loads its trained weights; and :class:`PreferenceEval` over ``dataset_val``."""
    loss = instantiate(cfg.loss)
    kind = reference_choice(cfg, adapters=memory.lora is not None)
    train_loader, val_loader, _ = data
    reference = None
    if loss.reference_free:
        log.info("%s is reference-free: no reference model (reference=%s is not used)", type(loss).__name__, kind)
    elif kind == "copy" and run.world_size > 1:  # sharded like the policy, frozen
        with _starting_rng(run):
            copy, _ = setup_sharded_model(source, device=run.device, dtype=run.dtype, seed=run.seed,
                                          memory=MemoryConfig(), fsdp_reshard_after_forward=True)
        reference = ModelReference(copy.requires_grad_(False).eval(), autocast=run.autocast)
    elif kind == "copy":  # its block linears in fp8 with reference_storage_dtype: lossy
        with _starting_rng(run):
            copy, _ = setup_model(source, device=run.device, dtype=run.dtype,
                                  memory=reference_copy_memory(cfg.reference_storage_dtype), placement=run.placement,
                                  trainable=False)
        reference = ModelReference(copy.eval(), autocast=run.autocast)
        if cfg.reference_storage_dtype:
            log.warning("reference: a copy with its block weights stored as %s: lossy, its log-probs differ from the "
                        "starting model's by fp8 rounding (reference_storage_dtype=null: exact)",
                        cfg.reference_storage_dtype)
    else:
        starting = ModelReference(model, partial(adapters_disabled, model) if memory.lora is not None
                                  else contextlib.nullcontext, autocast=run.autocast)
        reference = starting if kind == "adapters_off" else _precompute(cfg, run, starting, source, tokenizer,
                                                                        train_loader, val_loader)
    log.info("preference loss %s, reference: %s", type(loss).__name__,
             "none" if reference is None else kind)
    objective = PreferenceObjective(loss, reference)
    if kind == "copy" and reference is not None:
        objective.frozen_tensors = (*reference.model.parameters(), *reference.model.buffers())
    return objective, None if val_loader is None else PreferenceEval(objective, val_loader, run)


@contextlib.contextmanager
def _starting_rng(run: RunContext):
    """torch's RNG as the run's setup left it for the policy's weights (seeded with ``run.seed``) while inside, and
    as it was on leaving: a copy of random weights (no checkpoint) is then drawn as the policy's base was, and the
    run's later draws (adapters, dropout) are those it makes without a copy."""
    devices = [run.device] if run.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(run.seed)
        yield


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _precompute(cfg, run: RunContext, reference: ModelReference, source: ModelSource, tokenizer, train_loader,
                val_loader) -> PrecomputedReference:
    """The reference log-probs of the training and held-out pairs, from the cache or computed by ``reference``."""
    cache_dir = cfg.reference_cache_dir or str(run.output_dir / "reference_cache")
    described = {"family": source.family, "args": repr(source.args), "seed": run.seed}
    fingerprint = {"model": model_fingerprint(source.checkpoint_dir, described), "tokenizer": tokenizer.fingerprint(),
                   "dtype": run.dtype_name}
    tables = {}
    for role, loader in (("train", train_loader), ("val", val_loader)):
        if loader is None:
            continue
        dataset = getattr(loader.dataset, "pairs", loader.dataset)  # packed rows: the pass runs over their pairs

        def compute(start: int, end: int, dataset=dataset) -> torch.Tensor:
            part = torch.utils.data.Subset(dataset, range(start, end))
            part.collate_fn = dataset.collate_fn
            rows = []
            for batch in build_dataloader(part, cfg.batch_size, seed=0, shuffle=False, drop_last=False):
                batch = {k: v.to(run.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                rows.append(torch.stack(reference(batch), dim=1))
            return torch.cat(rows)

        tables[dataset.fingerprint] = cached_reference_logps(
            cache_dir, role, {**fingerprint, "data": dataset.fingerprint}, len(dataset), compute,
            writer=run.is_main, barrier=_barrier)
    return PrecomputedReference(tables)

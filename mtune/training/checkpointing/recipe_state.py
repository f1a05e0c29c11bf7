"""``recipe_state.pt``: what a run needs, besides the weights, to continue exactly where it stopped.

It holds the optimizer, LR scheduler and loss scaler states, the step and epoch, the data loader position and every
RNG state (see :mod:`mtune.training.rng`), and loads with ``torch.load(weights_only=True)``.

:func:`check_resume_compatible` decides whether a changed config may continue a checkpoint (see ``docs/training.md``,
"Resuming").
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from mtune.errors import MtuneError, PathNotFoundError
from mtune.training.memory import registry
from mtune.training.checkpointing.manifest import UNREADABLE_HINT, DamagedCheckpointError, open_for_write
from mtune.training.rng import get_rng_state, set_rng_state

__all__ = [
    "RECIPE_STATE_FILENAME",
    "RecipeState",
    "save_recipe_state",
    "load_recipe_state",
    "check_resume_compatible",
    "ResumeError",
    "MUST_MATCH_ON_RESUME",
    "MAY_CHANGE_ON_RESUME",
    "resume_classes",
]

RECIPE_STATE_FILENAME = "recipe_state.pt"

# Top-level config keys whose change alters the model, the data order or the optimisation, so a resumed run would
# not be the continuation of the saved one. Keys in neither list are treated as these (refusing is the safe side).
# The memory techniques' keys are classified by their settings (``must_match_on_resume``), added below.
_RUN_KEYS_THAT_MUST_MATCH = (
    "recipe",
    "model",  # the architecture and the base weights (LoRA checkpoints do not hold them)
    "tokenizer",
    "dtype",
    "batch_size",
    "gradient_accumulation_steps",
    "optimizer",
    "lr_scheduler",
    "loss",
    "clip_grad_norm",
    "dataset",
    "seed",
    "reference_storage_dtype",  # an fp8 reference copy moves the losses (lossy)
)

# Keys that may differ: how long to train, where and how often to write, what to observe.
_RUN_KEYS_THAT_MAY_CHANGE = (
    "output_dir",
    "resume_from_checkpoint",
    "device",
    "epochs",
    "max_steps_per_epoch",
    "log_every_n_steps",
    "save_every_n_steps",
    "keep_last_n_checkpoints",
    "save_adapter_weights_only",
    "eval_every_n_steps",
    "dataset_val",
    "metric_logger",
    "profiler",
    "memory_breakdown",
    "plan_check",
    "task_eval",
    "distributed_backend",
    "fsdp_reshard_after_forward",
    "overwrite_output_dir",
    "force_unlock",  # how the run takes output_dir's lock
    "verify_checksums",  # whether files are checked when loaded
    "device_memory_limit",  # how much of the device the run may use, not what a step computes
    "oom_recovery",  # whether a step that ran out of memory is re-planned and runs again (same math)
    "reference",  # the three reference models give the same losses: only memory and time move
    "reference_cache_dir",
)


def resume_classes() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(must match, may change)``: the run's keys as listed above, and each memory technique's keys as the
    technique's settings classify them (``must_match_on_resume``; its other keys do not change what a step computes)."""
    must = tuple(name for t in registry.TECHNIQUES for name in t.Settings.must_match_on_resume())
    declared = [key.name for technique in registry.TECHNIQUES for key in technique.Settings.keys()]
    return (_RUN_KEYS_THAT_MUST_MATCH + must,
            _RUN_KEYS_THAT_MAY_CHANGE + tuple(name for name in declared if name not in must))


MUST_MATCH_ON_RESUME, MAY_CHANGE_ON_RESUME = resume_classes()
"""Keys a resumed run must keep, and keys it may change, as the registry was imported."""


class _Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


@dataclass
class RecipeState:
    """What :func:`load_recipe_state` returns besides restoring the objects passed to it."""

    step: int
    epoch: int
    extra: dict[str, Any] = field(default_factory=dict)


def save_recipe_state(checkpoint_dir: str | os.PathLike, *, step: int, epoch: int,
                      optimizer: _Stateful | None = None, lr_scheduler: _Stateful | None = None,
                      grad_scaler: _Stateful | None = None, dataloader: _Stateful | None = None,
                      extra: Mapping[str, Any] | None = None) -> Path:
    """Write ``recipe_state.pt`` into ``checkpoint_dir`` (a :class:`CheckpointWriter` temp dir) and return its path.

    Each of ``optimizer``, ``lr_scheduler``, ``grad_scaler``, ``dataloader`` is anything with ``state_dict()``
    (None to leave it out): e.g. ``torch.optim.AdamW``, a ``LambdaLR``, ``torch.amp.GradScaler``, mtune's loader.
    For FSDP, pass an object whose ``state_dict()`` returns the gathered full optimizer state. ``extra`` holds
    other plain values (ints, floats, strings, tensors). The RNG states of this process are saved too.
    """
    state = {
        "step": int(step),
        "epoch": int(epoch),
        "optimizer": None if optimizer is None else optimizer.state_dict(),
        "lr_scheduler": None if lr_scheduler is None else lr_scheduler.state_dict(),
        "grad_scaler": None if grad_scaler is None else grad_scaler.state_dict(),
        "dataloader": None if dataloader is None else dataloader.state_dict(),
        "rng": get_rng_state(),
        "extra": dict(extra or {}),
    }
    path = Path(checkpoint_dir) / RECIPE_STATE_FILENAME
    with open_for_write(path) as f:  # inside a checkpoint's temp dir: its crc32 is computed from the bytes written
        torch.save(state, f)
    return path


def load_recipe_state(checkpoint_dir: str | os.PathLike, *, optimizer: _Stateful | None = None,
                      lr_scheduler: _Stateful | None = None, grad_scaler: _Stateful | None = None,
                      dataloader: _Stateful | None = None, restore_rng: bool = True) -> RecipeState:
    """Load ``recipe_state.pt`` from ``checkpoint_dir`` into the objects given and restore the RNG states.

    Call it after the model, optimizer, scheduler and loader are built, as the last thing before training, so that
    no random draw happens between restoring the RNGs and the first step.
    """
    path = Path(checkpoint_dir) / RECIPE_STATE_FILENAME
    if not path.is_file():
        raise PathNotFoundError(f"Cannot resume: {path} is missing (was the checkpoint saved by an mtune recipe?)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated or overwritten: torch's reader raises RuntimeError, EOFError, pickle's
        raise DamagedCheckpointError(
            f"{path} is unreadable: not a whole torch.save file, truncated or overwritten ({type(err).__name__}: "
            f"{(str(err).splitlines() or [''])[0]})",
            UNREADABLE_HINT) from err
    for name, target in (("optimizer", optimizer), ("lr_scheduler", lr_scheduler), ("grad_scaler", grad_scaler),
                         ("dataloader", dataloader)):
        if target is None:
            continue
        if state[name] is None:
            raise ResumeError(f"Cannot resume: {path} holds no {name} state, but one was passed to load it into")
        target.load_state_dict(state[name])
    if restore_rng:
        set_rng_state(state["rng"])
    return RecipeState(step=state["step"], epoch=state["epoch"], extra=state["extra"])


class ResumeError(MtuneError, ValueError):
    """The config of this run cannot continue the checkpoint's run."""


def _differences(saved: Any, new: Any, prefix: str, out: list[str]) -> None:
    if isinstance(saved, Mapping) and isinstance(new, Mapping):
        for key in sorted(set(saved) | set(new), key=str):
            path = f"{prefix}.{key}" if prefix else str(key)
            if key not in saved:
                # a key added after the checkpoint was written, at its off value, trains as the run did
                if new[key] not in (None, False):
                    out.append(f"{path} (absent -> {new[key]!r})")
            elif key not in new:
                out.append(f"{path} ({saved[key]!r} -> absent)")
            else:
                _differences(saved[key], new[key], path, out)
    elif _plain(saved) != _plain(new):
        out.append(f"{prefix} ({saved!r} -> {new!r})")


def _plain(value: Any) -> Any:
    # YAML/JSON may turn tuples into lists; compare them alike.
    return list(value) if isinstance(value, tuple) else value


def check_resume_compatible(saved_cfg: Mapping[str, Any], cfg: Mapping[str, Any],
                            checkpoint: str | os.PathLike | None = None, saved_world_size: int = 1,
                            world_size: int = 1) -> None:
    """Raise :class:`ResumeError` naming every key that differs between the checkpoint's config ``saved_cfg`` (from
    its ``mtune_state.json``) and this run's resolved ``cfg``, unless the key is in :data:`MAY_CHANGE_ON_RESUME`.
    A key the checkpoint's config lacks (mtune added it later) counts as unchanged at ``null`` or ``false``, the
    value a new key takes to keep the behaviour before it.

    Both are plain dicts with interpolations resolved (``OmegaConf.to_container(cfg, resolve=True)``).
    On another number of ranks ``batch_size`` may differ as long as ``batch_size x world_size`` (the global batch)
    does not; a different global batch is refused, whatever ``batch_size`` says.
    """
    may_change = resume_classes()[1]
    saved = {k: v for k, v in saved_cfg.items() if k not in may_change}
    new = {k: v for k, v in cfg.items() if k not in may_change}
    differences: list[str] = []
    # The global batch (batch_size x ranks) must stay; the per-rank batch_size may change with the number of ranks.
    saved_batch, new_batch = saved.pop("batch_size", None), new.pop("batch_size", None)
    if isinstance(saved_batch, int) and isinstance(new_batch, int):
        if saved_world_size == world_size and saved_batch != new_batch:
            differences.append(f"batch_size ({saved_batch!r} -> {new_batch!r})")
        elif saved_batch * saved_world_size != new_batch * world_size:
            differences.append(f"global batch = batch_size x ranks ({saved_batch} x {saved_world_size} = "
                               f"{saved_batch * saved_world_size} -> {new_batch} x {world_size} = "
                               f"{new_batch * world_size})")
    elif saved_batch != new_batch:
        differences.append(f"batch_size ({saved_batch!r} -> {new_batch!r})")
    _differences(saved, new, "", differences)
    if differences:
        where = f" {checkpoint}" if checkpoint is not None else ""
        raise ResumeError(
            f"Cannot resume from checkpoint{where}: these keys differ from its config and change training: "
            f"{', '.join(differences)}. Set them back, or start a new run in another output_dir."
        )

"""What every recipe sets up first: logging, the device (and its CUDA allocator), the dtype, the seed and the output
directory."""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mtune.config.errors import ConfigError
from mtune.errors import OutputExistsError
from mtune.training.checkpointing.atomic import TMP_PREFIX
from mtune.training.checkpointing.checkpoint_dir import FINAL_NAME
from mtune.training.memory.oom import device_memory_budget
from mtune.training.placement import Placement
from mtune.training.precision import LossScaler, autocast, resolve_dtype, storage_dtype
from mtune.training.output_lock import OutputDirLockedError, lock_output_dir
from mtune.training.rng import set_seed
from mtune.units import format_bytes

__all__ = ["RunContext", "setup_run", "prepare_cuda", "configure_cuda_allocator", "users_allocator_settings",
           "limit_cuda_memory", "resolve_device", "configure_logging", "claim_output_dir", "run_outputs"]

log = logging.getLogger(__name__)


@dataclass
class RunContext:
    """The settings of one process of a run, derived once from the config.

    Attributes:
        device: where the model trains (``cuda:<local_rank>`` in distributed CUDA runs).
        dtype_name: the config's ``dtype`` (``fp32``, ``bf16`` or ``fp16``).
        dtype: the storage dtype of the parameters (fp32 for ``fp16``, which computes under autocast).
        output_dir: where checkpoints, ``metrics.jsonl`` and plots go.
        rank, world_size: this process in a distributed run (0 and 1 on one device).
        placement: ``device`` and the host (CPU) memory the offloading techniques move tensors to.
    """

    device: torch.device
    dtype_name: str
    dtype: torch.dtype
    output_dir: Path
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    placement: Placement = field(default=None)  # type: ignore[assignment]  # set from device when not given

    def __post_init__(self):
        if self.placement is None:
            self.placement = Placement(self.device)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def autocast(self):
        """fp16 autocast for ``dtype=fp16``, a no-op context otherwise."""
        return autocast(self.dtype_name, self.device)

    def loss_scaler(self) -> LossScaler:
        """Dynamic loss scaling for ``dtype=fp16``; a pass-through otherwise."""
        return LossScaler(self.dtype_name, self.device)


def configure_logging(rank: int = 0) -> None:
    """INFO lines from mtune on rank 0, warnings only on the others, to the current ``sys.stderr`` (re-pointed on
    every call: a program that runs several recipes in one process may have swapped stderr in between)."""
    level = logging.INFO if rank == 0 else logging.WARNING
    root = logging.getLogger("mtune")
    console = [h for h in root.handlers if getattr(h, "mtune_console", False)]
    if console:
        for handler in console:
            handler.stream = sys.stderr  # not setStream: it flushes the old stream, which may be closed by now
    elif not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("mtune: %(message)s"))
        handler.mtune_console = True
        root.addHandler(handler)
        root.propagate = False
    root.setLevel(level)


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto`` is the accelerator when there is one (CUDA first), else the CPU; a named device must exist."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank)
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device={name}: this machine has no CUDA GPU (or torch is a CPU build): set device=cpu")
        if device.index is None:
            device = torch.device("cuda", local_rank)
        if device.index >= torch.cuda.device_count():
            raise ConfigError(f"device={name}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    return device


# What a run writes into output_dir besides its checkpoints: finding any of them means the directory holds a run.
RUN_OUTPUTS = ("metrics.jsonl", "results.json", "loss_curve.png", "memory_breakdown.json", "memory_breakdown.png")


def run_outputs(output_dir: Path) -> list[Path]:
    """The outputs of an earlier run in ``output_dir``: its checkpoints (complete or half-written) and run files.
    An empty run file is no output: a run that failed before its first logged step leaves an empty
    ``metrics.jsonl`` and nothing to keep, and the same command, mended, may start again there."""
    if not output_dir.is_dir():
        return []
    found = [output_dir / name for name in RUN_OUTPUTS
             if (output_dir / name).exists() and (output_dir / name).stat().st_size > 0]
    found += sorted(p for p in output_dir.iterdir() if p.is_dir() and (
        p.name == FINAL_NAME or p.name.startswith(TMP_PREFIX) or re.fullmatch(r"step_\d+", p.name)))
    return found


def claim_output_dir(output_dir: Path, *, resuming: bool, overwrite: bool, is_main: bool) -> None:
    """Refuse an ``output_dir`` that already holds a run, unless this run resumes it or ``overwrite_output_dir``
    asks to replace it (then the earlier run's checkpoints and run files are deleted, by the main process)."""
    found = run_outputs(output_dir)
    if not found or resuming:
        return
    names = ", ".join(p.name for p in found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    if not overwrite:
        raise OutputExistsError(
            f"output_dir={output_dir} already holds a run ({names})",
            "resume it with resume_from_checkpoint=true, choose another output_dir, or set overwrite_output_dir=true "
            "to delete that run and start again")
    if is_main:
        for path in found:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        log.warning("overwrite_output_dir=true: deleted the earlier run in %s (%s)", output_dir, names)


def setup_run(cfg, rank: int = 0, world_size: int = 1) -> RunContext:
    """From a config with its defaults filled in (``device``, ``dtype``, ``seed``, ``output_dir``,
    ``resume_from_checkpoint``, ``overwrite_output_dir``, ``force_unlock``): configure logging, resolve device and
    dtype (one clear error when the device cannot do it), seed every RNG, lock ``output_dir`` for this run (see
    :mod:`mtune.training.output_lock`; refused while another run holds it) and claim it (refused when it holds
    another run; see :func:`claim_output_dir`)."""
    configure_logging(rank)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = resolve_device(cfg.device, local_rank)
    if device.type == "cuda":
        prepare_cuda(device, cfg.get("device_memory_limit"))
    dtype_name = cfg.dtype
    resolve_dtype(dtype_name, device)  # raises when the device cannot compute in it
    seed = cfg.seed
    set_seed(seed)
    output_dir = Path(cfg.output_dir)
    _lock_output_dir(output_dir, force=bool(cfg.get("force_unlock")), rank=rank)
    claim_output_dir(output_dir, resuming=bool(cfg.resume_from_checkpoint), overwrite=cfg.overwrite_output_dir,
                     is_main=rank == 0)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # the main process has deleted an overwritten run before anyone writes
    run = RunContext(device=device, dtype_name=dtype_name, dtype=storage_dtype(dtype_name), output_dir=output_dir,
                     seed=seed, rank=rank, world_size=world_size)
    log.info("device %s, dtype %s, seed %d, output_dir %s", device, dtype_name, seed, output_dir)
    return run


ALLOCATOR_SETTINGS_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""Where a user configures PyTorch's caching allocator (the second is the newer, device-neutral name)."""

EXPANDABLE_SEGMENTS = "expandable_segments:True"
"""mtune's allocator setting where the user chose none: segments that grow by mapping pages instead of a new
``cudaMalloc`` per size class, so freed memory of one size serves a request of another. Measured on an H100 (GPU
suite part 17, docs/benchmarks.md): the two runs that the default allocator refused at ``--fit``'s margin (plan +
1 GiB) trained with it, 0.32 and 0.42 GiB reserved beyond allocated."""


def prepare_cuda(device: torch.device, limit=None) -> None:
    """Make ``device`` current, configure the caching allocator (:func:`configure_cuda_allocator`) before the run
    allocates, and apply ``device_memory_limit`` (:func:`limit_cuda_memory`)."""
    torch.cuda.set_device(device)
    log.info(configure_cuda_allocator())
    limit_cuda_memory(limit, device)


def users_allocator_settings() -> tuple[str, str] | None:
    """``(variable, value)`` of the first of :data:`ALLOCATOR_SETTINGS_VARIABLES` set (not empty), or None."""
    return next(((name, os.environ[name]) for name in ALLOCATOR_SETTINGS_VARIABLES if os.environ.get(name)), None)


def configure_cuda_allocator() -> str:
    """Expandable segments (:data:`EXPANDABLE_SEGMENTS`) unless ``PYTORCH_CUDA_ALLOC_CONF`` or
    ``PYTORCH_ALLOC_CONF`` is set, in which case the user's settings stand as PyTorch read them. Set at run time
    (``torch.cuda.memory._set_allocator_settings``, as PyTorch's own tests do), since the variable may have been
    read when torch loaded; it applies to every segment reserved after it. Returns the line the run logs."""
    users = users_allocator_settings()
    if users is not None:
        return f"CUDA allocator: {users[0]}={users[1]} (yours; mtune's default is {EXPANDABLE_SEGMENTS})"
    set_settings = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if set_settings is None:  # a torch without the call: say so rather than run as if it were set
        return (f"CUDA allocator: PyTorch's defaults (this torch cannot set {EXPANDABLE_SEGMENTS} at run time; "
                f"export PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE_SEGMENTS} for --fit's measured margin)")
    set_settings(EXPANDABLE_SEGMENTS)
    return f"CUDA allocator: {EXPANDABLE_SEGMENTS} (mtune's default; set PYTORCH_CUDA_ALLOC_CONF to choose others)"


def limit_cuda_memory(limit, device: torch.device) -> None:
    """``device_memory_limit`` on CUDA: the caching allocator's per-process fraction of the device (over it,
    torch.OutOfMemoryError). Off CUDA the run's byte tracker enforces it (`mtune.training.measured_memory`)."""
    if limit is None:
        return
    total = torch.cuda.get_device_properties(device).total_memory
    size = device_memory_budget(limit, device)
    torch.cuda.set_per_process_memory_fraction(size / total, device)
    log.info("device_memory_limit: %s of %s's %s", format_bytes(size), device, format_bytes(total))


def _lock_output_dir(output_dir: Path, *, force: bool, rank: int) -> None:
    """Global rank 0 takes the lock of ``output_dir`` (creating the directory); the other ranks wait for its verdict
    and raise the same one-line error when it was refused."""
    refused: list = [None]
    if rank == 0:
        try:
            lock_output_dir(output_dir, force=force)
        except OutputDirLockedError as err:
            refused = [(str(err), err.hint)]
        except OSError as err:
            if output_dir.exists() and not output_dir.is_dir():
                raise ConfigError(f"output_dir={output_dir} is a file, not a directory: name a directory for the "
                                  "run's checkpoints and logs") from None
            raise ConfigError(f"output_dir={output_dir}: cannot create it ({err.strerror})") from None
    if torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(refused, src=0)
    if refused[0] is not None:
        raise OutputDirLockedError(*refused[0])

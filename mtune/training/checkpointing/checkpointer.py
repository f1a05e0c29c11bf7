"""Save and resume single-device runs: ``${output_dir}/step_<N>/`` and ``${output_dir}/final/``.

A checkpoint directory holds:

- ``model/``: the model in Hugging Face format (full fine-tunes; and for LoRA the merged model, unless
  ``save_adapter_weights_only``), loadable by ``transformers.AutoModelForCausalLM.from_pretrained``;
- ``adapter/``: for LoRA / DoRA / QLoRA, the adapter in PEFT format (``peft.PeftModel.from_pretrained``);
- ``recipe_state.pt``: optimizer, scheduler, loss scaler, step, epoch, data position and RNG states;
- ``checksums/rank_<r>.json``: size and CRC-32 of every file, computed while writing (checked on resume);
- ``mtune_state.json``: what produced it (written last: a directory without it is not a checkpoint).

Writes go to a temporary directory renamed into place (see :class:`CheckpointWriter`), so a crash never leaves a
checkpoint that looks complete.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from mtune.modules.lora_state import merge_lora_weights
from mtune.training.memory import phases
from mtune.training.memory.registry import MemoryConfig
from mtune.training.checkpointing.checkpoint_dir import (
    FINAL_NAME,
    CheckpointWriter,
    find_latest_checkpoint,
    list_checkpoints,
    read_checkpoint_state,
)
from mtune.training.checkpointing.dcp import (
    DISTRIBUTED_STATE_DIRNAME,
    load_distributed_state,
    save_distributed_state,
    save_gathered_hf_checkpoint,
)
from mtune.training.checkpointing.disk_space import predicted_bytes, warn_if_short
from mtune.training.checkpointing.hf import load_hf_checkpoint, save_hf_checkpoint
from mtune.training.checkpointing.manifest import (DamagedCheckpointError, Manifest, has_checksums, recording,
                                                   verify_checkpoint)
from mtune.training.checkpointing.merge import merged_hf_weights, save_merged_model
from mtune.training.checkpointing.peft import load_peft_adapter, save_peft_adapter
from mtune.training.checkpointing.recipe_state import (RecipeState, check_resume_compatible, load_recipe_state,
                                                       save_recipe_state)

__all__ = ["Checkpointer", "DistributedCheckpointer", "MODEL_SUBDIR", "ADAPTER_SUBDIR"]

log = logging.getLogger(__name__)
MODEL_SUBDIR, ADAPTER_SUBDIR = "model", "adapter"


class Checkpointer:
    """Writes checkpoints of one run and resumes from them.

    Args:
        output_dir: the run's output directory.
        config: the resolved run config (plain dict), recorded in ``mtune_state.json`` and compared on resume.
        base_checkpoint_dir: the Hugging Face checkpoint the run started from (None for random weights); its
            config, tokenizer and generation files are copied into saved models, and a LoRA merge reads the base
            weights from it in their original precision.
        lora: the run's `LoraConfig` (or the config's ``lora`` node), or None for a full fine-tune.
        save_adapter_weights_only: LoRA: skip the merged model.
        keep_last_n_checkpoints: prune older ``step_<N>`` checkpoints once a new one is complete.
        verify_checksums: check a checkpoint's files against its checksums before resuming from it.
        memory: the run's memory settings: a merge without a base checkpoint reads the model's own weights, which
            its techniques bring back whole first (`mtune.training.memory.phases.materialized`).
    """

    LATEST_INTACT = "latest_intact"
    """``resume_from_checkpoint=latest_intact``: the newest checkpoint whose files all match their checksums."""

    def __init__(self, *, output_dir: str | Path, config: Mapping[str, Any], base_checkpoint_dir: Path | None,
                 lora: Any = None, save_adapter_weights_only: bool = False,
                 keep_last_n_checkpoints: int | None = None, max_shard_size: int | str = "5GB",
                 world_size: int = 1, verify_checksums: bool = True, memory: MemoryConfig = MemoryConfig()):
        self.output_dir = Path(output_dir)
        self.memory = memory
        self.config = dict(config)
        self.base_checkpoint_dir = base_checkpoint_dir
        self.lora = lora  # the config's lora node or LoraConfig; the PEFT writer reads it
        self.save_adapter_weights_only = save_adapter_weights_only
        self.max_shard_size = max_shard_size
        self.world_size = world_size
        self.verify_checksums = verify_checksums
        self.writer = CheckpointWriter(self.output_dir, keep_last_n_checkpoints=keep_last_n_checkpoints)

    @property
    def kind(self) -> str:
        return "full" if self.lora is None else ("lora_adapter" if self.save_adapter_weights_only else "lora")

    # ------------------------------------------------------------------------------------------------- saving
    def check_room(self, model: nn.Module, optimizer=None) -> None:
        """Predict the first checkpoint's size (later ones are the last one's) and warn now if it does not fit."""
        adapter_only = self.lora is not None and self.save_adapter_weights_only
        self.writer.expected_bytes = predicted_bytes(model, optimizer, adapter_only=adapter_only,
                                                     merged=self.lora is not None)
        warn_if_short(self.output_dir, self.writer.expected_bytes, "first checkpoint (predicted)")

    def save(self, *, step: int, epoch: int, model: nn.Module, optimizer=None, lr_scheduler=None, loss_scaler=None,
             dataloader=None, final: bool = False, state: Mapping[str, Any] | None = None) -> Path:
        """Write ``step_<step>/`` (or ``final/``) atomically and return its path; ``state`` adds entries to its
        ``mtune_state.json`` (the run's length)."""

        def write(tmp: Path) -> None:
            self._write_model(model, tmp)
            save_recipe_state(tmp, step=step, epoch=epoch, optimizer=optimizer, lr_scheduler=lr_scheduler,
                              grad_scaler=loss_scaler, dataloader=dataloader)

        path = self.writer.save(step=step, epoch=epoch, config=self.config, kind=self.kind, write_fn=write,
                                final=final, world_size=self.world_size, state=state)
        log.info("checkpoint: %s", path)
        return path

    def _write_model(self, model: nn.Module, tmp: Path) -> None:
        source = self.base_checkpoint_dir
        args = getattr(model, "args", None)
        if self.lora is None:
            save_hf_checkpoint(model, tmp / MODEL_SUBDIR, source_dir=source, max_shard_size=self.max_shard_size,
                               model_args=args)
            return
        save_peft_adapter(model, tmp / ADAPTER_SUBDIR, self.lora,
                          base_model_name_or_path=str(source) if source is not None else None)
        if self.save_adapter_weights_only:
            return
        # The merged model users serve: the adapter folded into the base weights in the checkpoint's own precision
        # (for QLoRA, not the NF4 weights the run trained against; see docs/checkpoints.md).
        if source is not None:
            weights = merged_hf_weights(source, model)
        else:  # no base checkpoint (random weights): merge the model's own, offloaded ones brought back for it
            with phases.materialized(model, self.memory):
                # Copied out inside the context: unmerged frozen weights are the offloaded tensors themselves, whose
                # device storage is freed again when it ends.
                weights = {k: v.detach().to("cpu", copy=True) for k, v in merge_lora_weights(model).items()}
        save_hf_checkpoint(weights, tmp / MODEL_SUBDIR, source_dir=source, max_shard_size=self.max_shard_size,
                           model_args=args)

    # ------------------------------------------------------------------------------------------------ resuming
    def find(self, resume_from: bool | str) -> Path | None:
        """The checkpoint ``resume_from_checkpoint`` names: the latest complete one in ``output_dir`` for true, the
        newest intact one for ``latest_intact``, or the given directory. None when there is none yet (the run
        starts fresh). With ``verify_checksums`` a checkpoint whose files do not match their checksums is refused
        with one line naming the file and the newest intact checkpoint before it."""
        if resume_from == self.LATEST_INTACT:
            return self._latest_intact()
        if resume_from is True:
            path = find_latest_checkpoint(self.output_dir, strict=True)
            if path is None:
                log.info("resume_from_checkpoint=true: no complete checkpoint in %s yet, starting fresh",
                         self.output_dir)
                return None
        else:
            path = Path(resume_from)
            read_checkpoint_state(path)  # raises when the directory is not a complete checkpoint
        self._check_intact(path)
        return path

    def _newest_first(self) -> list[Path]:
        """The complete checkpoints of ``output_dir``, newest first (``final`` before a ``step_<N>`` of its step)."""
        found = [(step, 1, path) for step, path in list_checkpoints(self.output_dir)]
        final = self.output_dir / FINAL_NAME
        if (final / "mtune_state.json").is_file():
            found.append((read_checkpoint_state(final)["step"], 2, final))
        return [path for *_, path in sorted(found, reverse=True)]

    def _check_intact(self, path: Path) -> None:
        if not self.verify_checksums:
            return
        problems = verify_checkpoint(path)
        if not problems:
            if not has_checksums(path):
                log.info("%s has no checksums (saved by an older mtune): its files are not verified", path)
            return
        step = read_checkpoint_state(path)["step"]
        earlier = [p for p in self._newest_first() if p != path and read_checkpoint_state(p)["step"] <= step]
        intact = next((p for p in earlier if not verify_checkpoint(p)), None)
        where = (f"resume_from_checkpoint={intact} (or resume_from_checkpoint={self.LATEST_INTACT}) resumes from the "
                 f"newest intact checkpoint before it" if intact is not None else
                 f"no earlier intact checkpoint in {self.output_dir}: start again in another output_dir")
        raise DamagedCheckpointError(f"checkpoint {path} is damaged: {problems[0]}",
                              f"{where}; verify_checksums=false loads it anyway")

    def _latest_intact(self) -> Path | None:
        checkpoints = self._newest_first()
        for path in checkpoints:
            problems = verify_checkpoint(path) if self.verify_checksums else []
            if not problems:
                return path
            log.warning("resume_from_checkpoint=%s: skipping %s, which is damaged (%s)", self.LATEST_INTACT, path,
                        problems[0])
        if checkpoints:
            raise DamagedCheckpointError(f"resume_from_checkpoint={self.LATEST_INTACT}: every checkpoint in "
                                  f"{self.output_dir} is damaged", "start again in another output_dir")
        log.info("resume_from_checkpoint=%s: no complete checkpoint in %s yet, starting fresh", self.LATEST_INTACT,
                 self.output_dir)
        return None

    def resume(self, path: Path, *, model: nn.Module, optimizer=None, lr_scheduler=None, loss_scaler=None,
               dataloader=None) -> RecipeState:
        """Check the config against the checkpoint's, load its weights and recipe state (RNG states last)."""
        state = read_checkpoint_state(path)
        check_resume_compatible(state["config"], self.config, checkpoint=path,
                                saved_world_size=state.get("world_size", 1), world_size=self.world_size)
        if self.lora is None:
            param = next(model.parameters())
            load_hf_checkpoint(model, path / MODEL_SUBDIR, dtype=param.dtype, device=param.device)
        else:
            load_peft_adapter(model, path / ADAPTER_SUBDIR)
        recipe_state = load_recipe_state(path, optimizer=optimizer, lr_scheduler=lr_scheduler,
                                         grad_scaler=loss_scaler, dataloader=dataloader)
        log.info("resumed from %s at step %d (epoch %d)", path, recipe_state.step, recipe_state.epoch)
        return recipe_state


class DistributedCheckpointer(Checkpointer):
    """Checkpoints of an FSDP2 run. Every rank writes its shards of the trainable parameters and their optimizer
    state with ``torch.distributed.checkpoint`` into ``distributed_state/`` (resumable on any number of ranks);
    rank 0 writes the gathered Hugging Face model / PEFT adapter (one tensor at a time), ``recipe_state.pt``
    (scheduler, data position, RNG) and commits the directory. ``output_dir`` must be on a filesystem every rank
    sees (one machine, or a shared filesystem across machines).
    """

    def __init__(self, *, rank: int, **kwargs):
        super().__init__(**kwargs)
        self.rank = rank

    def save(self, *, step: int, epoch: int, model: nn.Module, optimizer=None, lr_scheduler=None, loss_scaler=None,
             dataloader=None, final: bool = False, state: Mapping[str, Any] | None = None) -> Path:
        def write_shared(tmp: Path) -> None:
            self._write_model(model, tmp)  # gathers: every rank takes part, rank 0 writes
            save_distributed_state(tmp / DISTRIBUTED_STATE_DIRNAME, model, optimizer, adapter_only=self.lora is not None)
            if self.rank == 0:
                save_recipe_state(tmp, step=step, epoch=epoch, lr_scheduler=lr_scheduler, grad_scaler=loss_scaler,
                                  dataloader=dataloader)
            dist.barrier()

        if self.rank != 0:
            shared = [None]
            dist.broadcast_object_list(shared, src=0)
            manifest = Manifest(shared[0], rank=self.rank)  # this rank's own files: its DCP shards
            with recording(manifest):
                write_shared(Path(shared[0]))
            manifest.finish()
            dist.barrier()  # every rank's checksums are in the temp dir
            dist.barrier()  # rank 0 commits the directory
            return self.writer.checkpoint_path(step, final)
        with self.writer.open(step=step, epoch=epoch, config=self.config, kind=self.kind, final=final,
                              world_size=self.world_size, state=state) as tmp:
            dist.broadcast_object_list([str(tmp)], src=0)
            write_shared(tmp)
            dist.barrier()  # the other ranks have written their checksums
        dist.barrier()
        path = self.writer.checkpoint_path(step, final)
        log.info("checkpoint: %s", path)
        return path

    def _write_model(self, model: nn.Module, tmp: Path) -> None:
        source = self.base_checkpoint_dir
        if self.lora is None:
            save_gathered_hf_checkpoint(model, tmp / MODEL_SUBDIR, source_dir=source, max_shard_size="1GB",
                                        plain=phases.plain_form(self.memory))
            return
        save_peft_adapter(model, tmp / ADAPTER_SUBDIR, self.lora,
                          base_model_name_or_path=str(source) if source is not None else None)
        if self.save_adapter_weights_only or self.rank != 0:
            return
        if source is None:  # random base weights: merge the gathered tensors on rank 0 is not possible cheaply
            log.info("no base checkpoint: the merged model is not written (save_adapter_weights_only applies)")
            return
        # Streamed from the base checkpoint on rank 0, one tensor at a time: never the whole model in memory.
        save_merged_model(source, tmp / ADAPTER_SUBDIR, tmp / MODEL_SUBDIR, max_shard_size="1GB")

    def find(self, resume_from: bool | str) -> Path | None:
        found = [super().find(resume_from) if self.rank == 0 else None]
        dist.broadcast_object_list(found, src=0)  # rank 0 cleans half-written dirs and decides for every rank
        return found[0]

    def resume(self, path: Path, *, model: nn.Module, optimizer=None, lr_scheduler=None, loss_scaler=None,
               dataloader=None) -> RecipeState:
        state = read_checkpoint_state(path)
        check_resume_compatible(state["config"], self.config, checkpoint=path,
                                saved_world_size=state.get("world_size", 1), world_size=self.world_size)
        load_distributed_state(path / DISTRIBUTED_STATE_DIRNAME, model, optimizer, adapter_only=self.lora is not None)
        recipe_state = load_recipe_state(path, lr_scheduler=lr_scheduler, grad_scaler=loss_scaler,
                                         dataloader=dataloader)
        log.info("resumed from %s at step %d (epoch %d)", path, recipe_state.step, recipe_state.epoch)
        return recipe_state

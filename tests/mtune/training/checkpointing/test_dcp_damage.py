"""A damaged distributed checkpoint (its .distcp shards) read on resume: one line naming the checkpoint and the first
failing rank's reason, not torch.distributed.checkpoint's CheckpointException with every rank's traceback (a
~176-line report on two ranks, whose summary named no file)."""

import pytest
import torch

from mtune.models import build_model
from mtune.modules.lora import apply_lora
from mtune.training.checkpointing.dcp import load_distributed_state, save_distributed_state
from mtune.training.checkpointing.manifest import DamagedCheckpointError


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_truncated_shard_is_one_line_naming_the_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = apply_lora(build_model("llama3_1", "tiny", device="cpu"), ["q_proj"], rank=4, alpha=8)
    adamw = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    save_distributed_state(tmp_path / "dcp", model, adamw, adapter_only=True)  # one process: one shard file
    load_distributed_state(tmp_path / "dcp", model, adamw, adapter_only=True)  # whole, it loads
    (shard,) = (tmp_path / "dcp").glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(DamagedCheckpointError) as err:
        load_distributed_state(tmp_path / "dcp", model, adamw, adapter_only=True)
    assert str(err.value).startswith(f"{tmp_path / 'dcp'} is unreadable: rank 0: RuntimeError: PytorchStreamReader")
    assert "\n" not in str(err.value) and err.value.hint.startswith("resume from an earlier checkpoint")

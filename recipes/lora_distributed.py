"""Fine-tune LoRA / DoRA adapters (QLoRA with lora.quantize_base=true) sharded with FSDP2 over several devices or
machines.

    mtune run --nproc_per_node 2 lora_distributed --config tiny/lora_distributed
    mtune run --nnodes 2 --node_rank 0 --rdzv_endpoint host0:29500 --nproc_per_node 8 \\
        lora_distributed --config llama3_1/70B_qlora_distributed

Each transformer block and then the root are sharded (FSDP2 `fully_shard`); every rank reads only its rows of the
checkpoint (NF4 weights stay NF4 shards) and a disjoint share of each global batch. Checkpoints hold the sharded
adapter and optimizer state (resumable on any number of ranks) and, written by rank 0 one tensor at a time, the PEFT
adapter and the merged Hugging Face model.
"""

from omegaconf import DictConfig

from mtune.config import RecipeSchema
from mtune.config.keys import DISTRIBUTED_KEYS, MODEL_NODES, RUN_KEYS, TRAINING_NODES
from mtune.config.rules import DISTRIBUTED_RUN_RULES
from mtune.training.memory.registry import (
    DISTRIBUTED_MEMORY_KEYS,
    DISTRIBUTED_MEMORY_RULES,
    LORA_KEYS,
    MEMORY_KEYS,
    MemoryConfig,
)

SCHEMA = RecipeSchema([RUN_KEYS, MEMORY_KEYS, MODEL_NODES, TRAINING_NODES, LORA_KEYS, DISTRIBUTED_KEYS,
                       DISTRIBUTED_MEMORY_KEYS],
                      rules=DISTRIBUTED_RUN_RULES + DISTRIBUTED_MEMORY_RULES)
SUPPORTS_DISTRIBUTED = True


def main(cfg: DictConfig) -> None:
    from mtune.training.context import setup_run
    from mtune.training.data_setup import setup_data, setup_tokenizer
    from mtune.training.distributed import destroy_distributed, init_distributed
    from mtune.training.loop import build_loss
    from mtune.training.optimizers import build_optimizer
    from mtune.training.model_setup import resolve_model_source, setup_sharded_model
    from mtune.training.session import TrainingSession

    # ---- setup: process group, device and dtype, tokenizer, sharded model with adapters, data, optimizer, loss
    rank, world_size, _ = init_distributed(cfg.distributed_backend)
    run = setup_run(cfg, rank=rank, world_size=world_size)
    memory = MemoryConfig.from_config(cfg)  # the lora node included
    source = resolve_model_source(cfg.model, verify_checksums=cfg.verify_checksums)
    tokenizer = setup_tokenizer(cfg.tokenizer, source)
    model, activation_context = setup_sharded_model(
        source, device=run.device, dtype=run.dtype, seed=run.seed, memory=memory,
        fsdp_reshard_after_forward=cfg.fsdp_reshard_after_forward)
    data = setup_data(cfg, tokenizer, rank=rank, world_size=world_size)
    optimizer = build_optimizer(cfg.optimizer, model, memory)
    loss_fn = build_loss(cfg.loss)  # null: cross-entropy over every labelled token
    session = TrainingSession.from_config(cfg, run, model=model, tokenizer=tokenizer, optimizer=optimizer, data=data,
                                          loss_fn=loss_fn, base_checkpoint_dir=source.checkpoint_dir,
                                          activation_context=activation_context)

    # ---- train
    for micro_batches in session.batches():
        result = session.train_step(micro_batches)
        session.end_step(result)

    # ---- save: final/ with the sharded state, the PEFT adapter and the merged model
    session.finish()
    destroy_distributed()


if __name__ == "__main__":
    from mtune._cli.launch_recipe import run_recipe_file

    run_recipe_file(__file__)

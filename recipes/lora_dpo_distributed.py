"""Preference-tune LoRA / DoRA adapters (QLoRA with lora.quantize_base=true) with DPO, IPO or SimPO, sharded with
FSDP2 over several devices or machines.

    mtune run --nproc_per_node 2 lora_dpo_distributed --config tiny/lora_dpo_distributed

`lora_dpo_single_device` sharded as `lora_distributed` shards: every rank reads its rows of the checkpoint and a
disjoint share of each global batch of pairs (chosen and rejected rows of a pair stay together). The reference is
the policy with its adapters disabled (`reference: adapters_off`, the default), precomputed log-probs (every rank
computes the pass in step, rank 0 writes the cache) or a frozen copy, sharded like the policy.
"""

from omegaconf import DictConfig

from mtune.config import RecipeSchema
from mtune.config.keys import DISTRIBUTED_KEYS, MODEL_NODES, PREFERENCE_KEYS, RUN_KEYS, TRAINING_NODES
from mtune.config.rules import DISTRIBUTED_RUN_RULES, PREFERENCE_RULES
from mtune.training.memory.registry import (
    DISTRIBUTED_MEMORY_KEYS,
    DISTRIBUTED_MEMORY_RULES,
    LORA_KEYS,
    MEMORY_KEYS,
    MemoryConfig,
)

SCHEMA = RecipeSchema([RUN_KEYS, MEMORY_KEYS, MODEL_NODES, TRAINING_NODES, LORA_KEYS, DISTRIBUTED_KEYS,
                       DISTRIBUTED_MEMORY_KEYS, PREFERENCE_KEYS],
                      rules=DISTRIBUTED_RUN_RULES + DISTRIBUTED_MEMORY_RULES + PREFERENCE_RULES)
SUPPORTS_DISTRIBUTED = True


def main(cfg: DictConfig) -> None:
    from mtune.training.context import setup_run
    from mtune.training.data_setup import setup_data, setup_tokenizer
    from mtune.training.distributed import destroy_distributed, init_distributed
    from mtune.training.optimizers import build_optimizer
    from mtune.training.model_setup import resolve_model_source, setup_sharded_model
    from mtune.training.reference import setup_preference
    from mtune.training.session import TrainingSession

    # ---- setup: process group, device and dtype, tokenizer, sharded model with adapters, pairs, optimizer
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
    # the preference loss and its reference model (precomputed: the pass over the pairs runs here)
    objective, held_out = setup_preference(cfg, run, model=model, source=source, tokenizer=tokenizer, data=data,
                                           memory=memory)
    session = TrainingSession.from_config(cfg, run, model=model, tokenizer=tokenizer, optimizer=optimizer, data=data,
                                          base_checkpoint_dir=source.checkpoint_dir,
                                          activation_context=activation_context, loss_fn=objective,
                                          task_eval=held_out)

    # ---- train
    for micro_batches in session.batches():
        result = session.train_step(micro_batches)
        session.end_step(result)

    # ---- save: final/ with the sharded state, the PEFT adapter and the merged model; held-out reward accuracy
    session.finish()
    destroy_distributed()


if __name__ == "__main__":
    from mtune._cli.launch_recipe import run_recipe_file

    run_recipe_file(__file__)

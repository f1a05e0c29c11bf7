"""Preference-tune every weight with DPO, IPO or SimPO, sharded with FSDP2 over several devices or machines.

    mtune run --nproc_per_node 2 full_dpo_distributed --config tiny/full_dpo_distributed
    mtune run --nproc_per_node 8 full_dpo_distributed --config llama3_1/8B_full_dpo_distributed

`full_dpo_single_device` sharded as `full_distributed` shards. The reference is the starting checkpoint: its
log-probs precomputed before training (`reference: precomputed`, the default: every rank computes the pass in step,
rank 0 writes the cache), so training holds no second model; or a frozen copy, sharded like the policy.
"""

from omegaconf import DictConfig

from mtune.config import RecipeSchema
from mtune.config.keys import DISTRIBUTED_KEYS, MODEL_NODES, PREFERENCE_KEYS, RUN_KEYS, TRAINING_NODES
from mtune.config.rules import DISTRIBUTED_RUN_RULES, FULL_PREFERENCE_RULES
from mtune.training.memory.registry import DISTRIBUTED_MEMORY_KEYS, DISTRIBUTED_MEMORY_RULES, MEMORY_KEYS, MemoryConfig

SCHEMA = RecipeSchema([RUN_KEYS, MEMORY_KEYS, MODEL_NODES, TRAINING_NODES, DISTRIBUTED_KEYS,
                       DISTRIBUTED_MEMORY_KEYS, PREFERENCE_KEYS],
                      rules=DISTRIBUTED_RUN_RULES + DISTRIBUTED_MEMORY_RULES + FULL_PREFERENCE_RULES)
SUPPORTS_DISTRIBUTED = True


def main(cfg: DictConfig) -> None:
    from mtune.training.context import setup_run
    from mtune.training.data_setup import setup_data, setup_tokenizer
    from mtune.training.distributed import destroy_distributed, init_distributed
    from mtune.training.optimizers import build_optimizer
    from mtune.training.model_setup import resolve_model_source, setup_sharded_model
    from mtune.training.reference import setup_preference
    from mtune.training.session import TrainingSession

    # ---- setup: process group, device and dtype, tokenizer, sharded model, pairs, optimizer
    rank, world_size, _ = init_distributed(cfg.distributed_backend)
    run = setup_run(cfg, rank=rank, world_size=world_size)
    memory = MemoryConfig.from_config(cfg)
    source = resolve_model_source(cfg.model, verify_checksums=cfg.verify_checksums)
    tokenizer = setup_tokenizer(cfg.tokenizer, source)
    model, activation_context = setup_sharded_model(
        source, device=run.device, dtype=run.dtype, seed=run.seed, memory=memory,
        fsdp_reshard_after_forward=cfg.fsdp_reshard_after_forward)
    data = setup_data(cfg, tokenizer, rank=rank, world_size=world_size)
    optimizer = build_optimizer(cfg.optimizer, model, memory)
    # the preference loss and its reference model (precomputed: the pass over the pairs runs here, before a
    # resumed run loads its trained weights)
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

    # ---- save: final/ with the sharded state and the Hugging Face model; the held-out reward accuracy
    session.finish()
    destroy_distributed()


if __name__ == "__main__":
    from mtune._cli.launch_recipe import run_recipe_file

    run_recipe_file(__file__)

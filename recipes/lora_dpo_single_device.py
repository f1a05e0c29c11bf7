"""Preference-tune LoRA / DoRA adapters (QLoRA with lora.quantize_base=true) with DPO, IPO or SimPO on one device.

    mtune run lora_dpo_single_device --config tiny/lora_dpo_single_device
    mtune run lora_dpo_single_device --config llama3_1/8B_lora_dpo_single_device reference=precomputed

The data are pairs (a prompt, a chosen and a rejected response: `mtune.data.preference_dataset`); each micro-batch
runs the chosen and rejected rows through the policy in one forward. The reference model is the starting model
without adapters, by default the policy with its adapters disabled (`reference: adapters_off`, no second copy of
the weights); `precomputed` computes its log-probs once before training into a cache, `copy` keeps a frozen copy.
metrics.jsonl adds rewards/chosen, rewards/rejected, rewards/accuracies and rewards/margins; results.json the
held-out reward accuracy (dataset_val) before and after training.
"""

from omegaconf import DictConfig

from mtune.config import RecipeSchema
from mtune.config.keys import MODEL_NODES, PREFERENCE_KEYS, RUN_KEYS, TRAINING_NODES
from mtune.config.rules import PREFERENCE_RULES, RUN_RULES
from mtune.training.memory.registry import LORA_KEYS, MEMORY_KEYS, MEMORY_RULES, MemoryConfig

SCHEMA = RecipeSchema([RUN_KEYS, MEMORY_KEYS, MODEL_NODES, TRAINING_NODES, LORA_KEYS, PREFERENCE_KEYS],
                      rules=RUN_RULES + MEMORY_RULES + PREFERENCE_RULES)


def main(cfg: DictConfig) -> None:
    from mtune.training.context import setup_run
    from mtune.training.data_setup import setup_data, setup_tokenizer
    from mtune.training.optimizers import build_optimizer
    from mtune.training.model_setup import resolve_model_source, setup_model
    from mtune.training.reference import setup_preference
    from mtune.training.session import TrainingSession

    # ---- setup: device and dtype, tokenizer, model with adapters and memory techniques, pairs, optimizer
    run = setup_run(cfg)
    memory = MemoryConfig.from_config(cfg)  # the lora node included
    source = resolve_model_source(cfg.model, verify_checksums=cfg.verify_checksums)
    tokenizer = setup_tokenizer(cfg.tokenizer, source)
    model, activation_context = setup_model(source, device=run.device, dtype=run.dtype, memory=memory,
                                            placement=run.placement, verify_checksums=cfg.verify_checksums)
    data = setup_data(cfg, tokenizer)
    optimizer = build_optimizer(cfg.optimizer, model, memory, placement=run.placement)
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

    # ---- save: final/ with the PEFT adapter and the merged model; the held-out reward accuracy
    session.finish()


if __name__ == "__main__":
    from mtune._cli.launch_recipe import run_recipe_file

    run_recipe_file(__file__)

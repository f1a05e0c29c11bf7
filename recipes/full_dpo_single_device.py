"""Preference-tune every weight with DPO, IPO or SimPO on one device.

    mtune run full_dpo_single_device --config tiny/full_dpo_single_device
    mtune run full_dpo_single_device --config tiny/full_dpo_single_device reference=copy

The data are pairs (`mtune.data.preference_dataset`); each micro-batch runs the chosen and rejected rows through the
policy in one forward. The reference model is the starting checkpoint: by default its log-probs are computed once
before training into a cache (`reference: precomputed`, keyed by a fingerprint of data, model, tokenizer and dtype),
so training holds no second model; `copy` keeps a frozen copy beside the policy. Every `step_<N>/` and `final/`
holds the model in Hugging Face format.
"""

from omegaconf import DictConfig

from mtune.config import RecipeSchema
from mtune.config.keys import MODEL_NODES, PREFERENCE_KEYS, RUN_KEYS, TRAINING_NODES
from mtune.config.rules import FULL_PREFERENCE_RULES, RUN_RULES
from mtune.training.memory.registry import MEMORY_KEYS, MEMORY_RULES, MemoryConfig

SCHEMA = RecipeSchema([RUN_KEYS, MEMORY_KEYS, MODEL_NODES, TRAINING_NODES, PREFERENCE_KEYS],
                      rules=RUN_RULES + MEMORY_RULES + FULL_PREFERENCE_RULES)


def main(cfg: DictConfig) -> None:
    from mtune.training.context import setup_run
    from mtune.training.data_setup import setup_data, setup_tokenizer
    from mtune.training.optimizers import build_optimizer
    from mtune.training.model_setup import resolve_model_source, setup_model
    from mtune.training.reference import setup_preference
    from mtune.training.session import TrainingSession

    # ---- setup: device and dtype, tokenizer, model with memory techniques, pairs, optimizer
    run = setup_run(cfg)
    memory = MemoryConfig.from_config(cfg)
    source = resolve_model_source(cfg.model, verify_checksums=cfg.verify_checksums)
    tokenizer = setup_tokenizer(cfg.tokenizer, source)
    model, activation_context = setup_model(source, device=run.device, dtype=run.dtype, memory=memory,
                                            placement=run.placement)
    data = setup_data(cfg, tokenizer)
    optimizer = build_optimizer(cfg.optimizer, model, memory, placement=run.placement)
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

    # ---- save: final/ with the model in Hugging Face format; the held-out reward accuracy
    session.finish()


if __name__ == "__main__":
    from mtune._cli.launch_recipe import run_recipe_file

    run_recipe_file(__file__)

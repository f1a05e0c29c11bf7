"""Fine-tune LoRA / DoRA adapters (QLoRA with lora.quantize_base=true) on one device.

    mtune run lora_single_device --config tiny/lora_single_device
    mtune run lora_single_device --config llama3_2/1B_qlora_single_device dtype=bf16 batch_size=8

Setup builds the model on the meta device, swaps the target linears for adapters (and the frozen base linears for
NF4 ones), applies the memory techniques, then streams the base weights in; the loop trains the adapters only.
Every `step_<N>/` and `final/` holds the adapter in PEFT format and, unless save_adapter_weights_only, the merged
model in Hugging Face format.
"""

from omegaconf import DictConfig

from mtune.config import RecipeSchema
from mtune.config.keys import MODEL_NODES, RUN_KEYS, TRAINING_NODES
from mtune.config.rules import RUN_RULES
from mtune.training.memory.registry import LORA_KEYS, MEMORY_KEYS, MEMORY_RULES, MemoryConfig

SCHEMA = RecipeSchema([RUN_KEYS, MEMORY_KEYS, MODEL_NODES, TRAINING_NODES, LORA_KEYS], rules=RUN_RULES + MEMORY_RULES)


def main(cfg: DictConfig) -> None:
    from mtune.training.context import setup_run
    from mtune.training.data_setup import setup_data, setup_tokenizer
    from mtune.training.loop import build_loss
    from mtune.training.optimizers import build_optimizer
    from mtune.training.model_setup import resolve_model_source, setup_model
    from mtune.training.session import TrainingSession

    # ---- setup: device and dtype, tokenizer, model with adapters and memory techniques, data, optimizer, loss
    run = setup_run(cfg)
    memory = MemoryConfig.from_config(cfg)  # the lora node included
    source = resolve_model_source(cfg.model, verify_checksums=cfg.verify_checksums)
    tokenizer = setup_tokenizer(cfg.tokenizer, source)
    model, activation_context = setup_model(source, device=run.device, dtype=run.dtype, memory=memory,
                                            placement=run.placement, verify_checksums=cfg.verify_checksums)
    data = setup_data(cfg, tokenizer)
    optimizer = build_optimizer(cfg.optimizer, model, memory, placement=run.placement)
    loss_fn = build_loss(cfg.loss)  # null: cross-entropy over every labelled token
    session = TrainingSession.from_config(cfg, run, model=model, tokenizer=tokenizer, optimizer=optimizer, data=data,
                                          loss_fn=loss_fn, base_checkpoint_dir=source.checkpoint_dir,
                                          activation_context=activation_context)

    # ---- train
    for micro_batches in session.batches():
        result = session.train_step(micro_batches)
        session.end_step(result)

    # ---- save: final/ with the PEFT adapter and the merged model
    session.finish()


if __name__ == "__main__":
    from mtune._cli.launch_recipe import run_recipe_file

    run_recipe_file(__file__)

"""The recipe-level config keys, declared once per group; recipes compose the groups they read.

Pure Python (no torch): `mtune validate` and `mtune run RECIPE --help` read these through a recipe's ``SCHEMA``,
and the docs tables are rendered from them. Names follow torchtune where torchtune has one.
"""

from __future__ import annotations

from mtune.config import REQUIRED, Key, KeyGroup, Node

RUN_KEYS = KeyGroup(
    "run",
    help="where a run writes, what it runs on, how long it trains and how often it logs and saves",
    keys=[
        Key("recipe", str, None, "the recipe this config is for (read by `mtune ls` and `mtune validate`)"),
        Key("output_dir", str, REQUIRED, "directory for checkpoints, metrics.jsonl and logs"),
        Key("seed", int, 0, "random seed for weight init, data order and dropout"),
        Key("device", str, "auto", "'auto' (the accelerator when there is one, else cpu), 'cpu', 'cuda', 'cuda:1', ..."),
        Key("dtype", str, "bf16", "storage dtype of the model; fp16 = fp32 weights with fp16 autocast and loss scaling",
            choices=("fp32", "bf16", "fp16")),
        Key("epochs", int, 1, "passes over the training set"),
        Key("max_steps_per_epoch", int, None, "stop each epoch after this many optimizer steps (null: whole epoch)"),
        Key("batch_size", int, 4, "samples per micro-batch on each device"),
        Key("gradient_accumulation_steps", int, 1, "micro-batches per optimizer step"),
        Key("clip_grad_norm", float, None, "clip the global gradient norm to this value (null: no clipping)"),
        Key("compile", bool, False, "torch.compile each transformer block and the loss"),
        Key("log_every_n_steps", int, 1, "write a line to metrics.jsonl every N optimizer steps"),
        Key("save_every_n_steps", int, None, "also checkpoint to step_<N>/ every N steps (null: only final/)"),
        Key("keep_last_n_checkpoints", int, None, "delete older step_<N>/ checkpoints beyond this many (null: keep all)"),
        Key("resume_from_checkpoint", (bool, str), False,
            "true: resume from the latest complete checkpoint in output_dir; or a checkpoint directory"),
        Key("eval_every_n_steps", int, None, "compute val_loss on dataset_val every N steps (null: never)"),
    ],
)

MEMORY_KEYS = KeyGroup(
    "memory",
    help="techniques that trade compute or transfers for memory",
    keys=[
        Key("enable_activation_checkpointing", bool, False, "recompute block activations in the backward pass"),
        Key("activation_checkpointing_every_n_layers", int, 1, "checkpoint every Nth transformer block"),
        Key("enable_activation_offloading", bool, False, "move saved activations to CPU memory until backward"),
        Key("activation_offloading_use_streams", bool, True, "overlap offloading transfers with compute (CUDA only)"),
        Key("optimizer_in_bwd", bool, False, "step each parameter's optimizer during backward and free its gradient"),
    ],
)

MODEL_NODES = KeyGroup(
    "model",
    help="the model and its tokenizer",
    keys=[
        Node(
            "model",
            "the checkpoint to start from",
            keys=KeyGroup(
                "model",
                [
                    Key("checkpoint_dir", str, None, "a Hugging Face model directory, as `mtune download` leaves it"),
                    Key("size", str, None, "instead of checkpoint_dir: build this named size with random weights"),
                    Key("family", str, None, "the family of `size` (llama2, llama3_1, llama3_2, qwen2_5, mistral, tiny)"),
                ],
            ),
            required=True,
        ),
        Node(
            "tokenizer",
            "the tokenizer's files",
            keys=KeyGroup(
                "tokenizer",
                [
                    Key("path", str, None, "a model directory or tokenizer file (default: model.checkpoint_dir)"),
                    Key("max_seq_len", int, None, "truncate samples to this many tokens (null: no limit)"),
                ],
            ),
            required=True,
        ),
    ],
)

TRAINING_NODES = KeyGroup(
    "training",
    help="components built with instantiate(); their keys are checked against the component's signature",
    keys=[
        Node("optimizer", "the optimizer (_component_ such as torch.optim.AdamW)", required=True),
        Node("lr_scheduler", "learning-rate schedule, stepped once per optimizer step (null: constant)"),
        Node("loss", "the loss (null: the library's cross-entropy)"),
        Node("dataset", "the training set builder, called with tokenizer=", required=True),
        Node("dataset_val", "the validation set builder (needed by eval_every_n_steps)"),
        Node("metric_logger", "where metrics go besides metrics.jsonl (null: only metrics.jsonl)"),
        Node("profiler", "torch.profiler settings (null: no profiling)"),
        Node("task_eval", "a task metric computed before and after training, e.g. exact-match accuracy (null: none)"),
        Key("memory_breakdown", bool, False,
            "measure parameter / gradient / optimizer-state / activation bytes over the first steps (JSON + PNG)"),
    ],
)

LORA_KEYS = KeyGroup(
    "lora",
    help="low-rank adapters (LoRA, DoRA, QLoRA)",
    keys=[
        Node(
            "lora",
            "adapter settings; module names are Hugging Face's",
            keys=KeyGroup(
                "lora",
                [
                    Key("modules", list, ["q_proj", "v_proj"],
                        "linears to adapt: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj lm_head"),
                    Key("rank", int, 8, "adapter rank r"),
                    Key("alpha", float, 16.0, "scale numerator: the update is scaled by alpha / rank"),
                    Key("dropout", float, 0.0, "dropout on the adapter input"),
                    Key("use_dora", bool, False, "DoRA: learn a per-output magnitude as well"),
                    Key("quantize_base", bool, False, "QLoRA: store the frozen base linears as NF4"),
                    Key("adapter_dir", str, None, "start from this saved PEFT adapter instead of a fresh one"),
                ],
            ),
            required=True,
        ),
        Key("save_adapter_weights_only", bool, False, "save only the PEFT adapter, not the merged model as well"),
    ],
)


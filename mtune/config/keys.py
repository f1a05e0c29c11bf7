"""The recipe-level config keys that are not a memory technique's, declared once per group; recipes compose the
groups they read. Each memory technique declares its own keys (`mtune.training.memory.techniques`), collected into
`mtune.training.memory.registry.MEMORY_KEYS` and ``LORA_KEYS``.

Pure Python (no torch): `mtune validate` and `mtune run RECIPE --help` read these through a recipe's ``SCHEMA``,
and the docs tables are rendered from them. Names follow torchtune where torchtune has one.
"""

from __future__ import annotations

from mtune.config.schema import REQUIRED, Key, KeyGroup, Node

DTYPE_NAMES = ("fp32", "bf16", "fp16")
"""The values of every ``dtype`` key; `mtune.training.precision.DTYPES` maps them to torch dtypes."""

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head",
                "qkv_proj", "gate_up_proj",  # the fused projections of Phi-4 and Phi-4-mini
                "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")  # Qwen3.5's Gated DeltaNet
"""The linears ``lora.modules`` may name (Hugging Face's module names)."""

ATTENTION_KERNELS = ("auto", "segments", "dense_mask")
"""The values of ``attention_kernel`` (the technique's key) and of `TransformerDecoder.attention_kernel`: declared
here, torch-free, so that both read the one tuple."""

# Keys several groups share, declared once.
RECIPE_KEY = Key("recipe", str, None, "the recipe this config is for (read by `mtune ls` and `mtune validate`)")
DEVICE_KEY = Key("device", str, "auto", "'auto' (the accelerator when there is one, else cpu), 'cpu', 'cuda', "
                 "'cuda:1', ...", pattern=r"auto|cpu|cuda(:\d+)?|mps|xpu(:\d+)?")
DTYPE_KEY = Key("dtype", str, "bf16", "dtype of the model's weights; fp16 = fp32 weights with fp16 autocast and loss "
                "scaling (training) or fp16 weights (generation)", choices=DTYPE_NAMES)

RUN_KEYS = KeyGroup(
    "run",
    help="where a run writes, what it runs on, how long it trains and how often it logs and saves",
    keys=[
        RECIPE_KEY,
        Key("output_dir", str, REQUIRED, "directory for checkpoints, metrics.jsonl and logs"),
        Key("seed", int, 0, "random seed for weight init, data order and dropout", at_least=0),
        DEVICE_KEY,
        DTYPE_KEY,
        Key("epochs", int, 1, "passes over the training set", at_least=1),
        Key("max_steps_per_epoch", int, None, "stop each epoch after this many optimizer steps (null: whole epoch)",
            at_least=1),
        Key("batch_size", int, 4, "samples per micro-batch on each device", at_least=1),
        Key("gradient_accumulation_steps", int, 1, "micro-batches per optimizer step", at_least=1),
        Key("clip_grad_norm", float, None, "clip the global gradient norm to this value (null: no clipping)", above=0),
        Key("log_every_n_steps", int, 1, "write a line to metrics.jsonl every N optimizer steps", at_least=1),
        Key("save_every_n_steps", int, None, "also checkpoint to step_<N>/ every N steps (null: only final/)",
            at_least=1),
        Key("keep_last_n_checkpoints", int, None, "delete older step_<N>/ checkpoints beyond this many (null: keep all)",
            at_least=1),
        Key("resume_from_checkpoint", (bool, str), False,
            "true: resume from the latest complete checkpoint in output_dir; latest_intact: from the newest one whose "
            "files match their checksums; or a checkpoint directory"),
        Key("verify_checksums", bool, True,
            "check every file of a checkpoint against the checksums saved with it before resuming from it or loading "
            "it (false: skip)"),
        Key("overwrite_output_dir", bool, False,
            "true: delete the run already in output_dir (checkpoints, metrics, plots) and start again; false: refuse "
            "such an output_dir unless resuming"),
        Key("eval_every_n_steps", int, None, "compute val_loss on dataset_val every N steps (null: never)", at_least=1),
        Key("force_unlock", bool, False,
            "true: take output_dir's lock although a run on another host holds it (only when that run is known to "
            "be gone; a stale lock on this host is taken without it)"),
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
                    Key("router_aux_loss_coef", float, None,
                        "MoE models: weight of the router load-balancing loss added to the training loss (null: the "
                        "checkpoint's own, on only where its output_router_logits is true; 0: off)", at_least=0),
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
                    Key("max_seq_len", int, None, "truncate samples to this many tokens (null: no limit)", at_least=1),
                    Key("options", dict, None,
                        "the tokenizer family's own settings (gpt-oss: reasoning_effort, current_date, "
                        "model_identity; Qwen3 / Qwen3.5: enable_thinking; Llama 3: date_header (auto | always | "
                        "never: the Llama 3.1+ templates' system turn with its date lines on conversations without "
                        "tool calling; auto: when the checkpoint's chat template has it), date_string (the date in "
                        "it), tools_in_user_message; null: the family's defaults); one the family does not take is "
                        "refused"),
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
        Node("dataset_val", "the held-out set builder, for val_loss (needed by eval_every_n_steps)"),
        Node("metric_logger", "where metrics go besides metrics.jsonl (null: only metrics.jsonl)"),
        Node("profiler", "torch.profiler settings (null: no profiling)"),
        Node("task_eval", "a task metric computed before and after training, e.g. exact-match accuracy (null: none)"),
        Key("memory_breakdown", bool, False,
            "write memory_breakdown.json/.png: live tensor bytes by category, device and host, of the first steps"),
        Key("plan_check", bool, True,
            "track live tensor bytes (peak_tensor_gib in metrics.jsonl) and log them beside mtune plan's prediction "
            "at the end of the run"),
        Key("device_memory_limit", (str, int), None,
            "the most device memory the run may use, a size such as 20GiB (null: the whole device): on CUDA the "
            "caching allocator's per-process fraction, on CPU the live tensor bytes the run places on the device; "
            "over it the run stops with the out-of-memory error a GPU gives"),
        Key("oom_recovery", bool, True,
            "a step that runs out of device memory in forward/backward is re-planned under the limit (the fastest "
            "lossless micro-batch, checkpointing, offloading with the same samples per step, written to "
            "output_dir/mtune_fit.yaml) and runs again; where nothing fits the run saves a checkpoint and stops; "
            "false: the run stops with the advice"),
    ],
)

DISTRIBUTED_KEYS = KeyGroup(
    "distributed",
    help="sharding with FSDP2 across devices and machines (launch with mtune run --nproc_per_node N ...)",
    keys=[
        Key("distributed_backend", str, None, "process-group backend (null: nccl on CUDA, gloo on CPU)"),
        Key("fsdp_reshard_after_forward", bool, True,
            "true: free gathered weights after each block's forward (ZeRO-3-like, least memory); false: keep them "
            "until backward (ZeRO-2-like, less communication)"),
    ],  # fsdp_cpu_offload: a memory technique's (registry.DISTRIBUTED_MEMORY_KEYS)
)

REFERENCE_CHOICES = ("adapters_off", "precomputed", "copy")
"""Where a preference recipe's reference log-probs come from: the policy with its adapters disabled (LoRA), a cache
computed before training, or a frozen copy of the starting model."""

REFERENCE_STORAGE_DTYPES = ("float8_e4m3fn", "float8_e5m2")
"""How a reference copy may store its block linears (the fp8 formats of ``weight_storage_dtype``)."""

PREFERENCE_KEYS = KeyGroup(
    "preference",
    help="preference tuning (DPO, IPO, SimPO): the reference model",
    keys=[
        Key("reference", str, None,
            "the reference model: adapters_off (the policy with its LoRA adapters disabled: no second copy), "
            "precomputed (its log-probs computed once before training and cached: no reference model while "
            "training), copy (a frozen copy of the starting model); null: adapters_off in the LoRA recipes, "
            "precomputed in the full ones. All three give the same losses in the model's dtype",
            choices=REFERENCE_CHOICES),
        Key("reference_storage_dtype", str, None,
            "reference: copy: store the copy's linear weights inside the blocks in this fp8 format (one fp32 scale "
            "per row): half the copy's bf16 bytes, lossy (its log-probs move by fp8's rounding); null: the model "
            "dtype", choices=REFERENCE_STORAGE_DTYPES),
        Key("reference_cache_dir", str, None,
            "reference: precomputed: where the reference log-probs are cached, keyed by a fingerprint of the data, "
            "model, tokenizer and dtype (null: ${output_dir}/reference_cache); reused by a run with the same "
            "fingerprint"),
    ],
)


def is_preference(cfg) -> bool:
    """Whether ``cfg`` is a preference recipe's (it holds `PREFERENCE_KEYS`, filled in by the recipe's schema): the
    one way mtune tells."""
    return cfg is not None and "reference" in cfg


def reference_choice(cfg, adapters: bool) -> str:
    """The run's reference model: its ``reference`` key, else adapters_off when the run trains adapters
    (``adapters``), precomputed when not: the one way it is read."""
    return cfg.get("reference") or ("adapters_off" if adapters else "precomputed")


MERGE_KEYS = KeyGroup(
    "merge",
    help="merge a saved PEFT adapter into its base checkpoint and write a Hugging Face model",
    keys=[
        RECIPE_KEY,
        Key("adapter_dir", str, REQUIRED, "a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)"),
        Key("base_model_dir", str, None,
            "the base Hugging Face checkpoint the adapter was trained on (null: model.checkpoint_dir, else the "
            "adapter's base_model_name_or_path)"),
        Node("model", "alternative spelling of the base: model.checkpoint_dir",
             keys=KeyGroup("model", [Key("checkpoint_dir", str, None, "the base Hugging Face model directory")])),
        Key("output_dir", str, REQUIRED, "where the merged model is written; must not exist yet (or be empty)"),
        Key("dtype", str, None, "dtype of the written weights (null: as stored in the base checkpoint)",
            choices=DTYPE_NAMES),
        Key("max_shard_size", (str, int), "5GB", "largest safetensors file, e.g. 5GB, 500MB or bytes"),
    ],
)


GENERATE_KEYS = KeyGroup(
    "generate",
    help="sample text from a model (a base or full checkpoint, or a base plus a PEFT adapter)",
    keys=[
        RECIPE_KEY,
        DEVICE_KEY,
        DTYPE_KEY,
        Key("seed", int, 0, "random seed for sampling"),
        Key("adapter_dir", str, None, "a PEFT adapter directory applied on top of model.checkpoint_dir (null: none)"),
        Key("prompt", str, None, "plain text to continue (BOS added where the family has one)"),
        Key("messages", list, None, "a chat: list of {role: system|user|assistant, content}; the assistant replies"),
        Key("max_new_tokens", int, 128, "stop after this many new tokens (or at a stop token)", at_least=1),
        Key("temperature", float, 0.0, "0 = greedy; otherwise logits are divided by it before sampling", at_least=0),
        Key("top_k", int, None, "sample among the k most likely tokens only (null: all)", at_least=1),
        Key("top_p", float, None, "sample from the smallest set of tokens whose probability reaches top_p (null: all)",
            above=0, at_most=1),
        Key("verify_checksums", bool, True,
            "check the files of an mtune checkpoint (model.checkpoint_dir, adapter_dir) against the checksums saved "
            "with it before loading (false: skip)"),
    ],
)
"""The generate recipe's own keys; it also reads ``weight_offloading`` (declared once, with the technique:
`mtune.training.memory.techniques.weight_offloading`)."""


def run_kind(cfg) -> str:
    """``distributed`` for a distributed recipe's config (it holds `DISTRIBUTED_KEYS`, filled in by the recipe's
    schema), else ``single_device``: the one way mtune tells the two apart."""
    return "distributed" if cfg is not None and "fsdp_reshard_after_forward" in cfg else "single_device"


def accumulation_steps(cfg) -> int:
    """Micro-batches per optimizer step: ``gradient_accumulation_steps``, 1 when the config leaves it out or null."""
    return int(cfg.get("gradient_accumulation_steps") or 1)


def samples_per_step(cfg) -> int:
    """Samples one rank puts into an optimizer step: ``batch_size`` x `accumulation_steps` (times the number of
    ranks for the global batch)."""
    return int(cfg["batch_size"]) * accumulation_steps(cfg)

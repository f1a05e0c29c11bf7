"""The recipe-level config keys, declared once per group; recipes compose the groups they read.

Pure Python (no torch): `mtune validate` and `mtune run RECIPE --help` read these through a recipe's ``SCHEMA``,
and the docs tables are rendered from them. Names follow torchtune where torchtune has one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from mtune.config.schema import REQUIRED, Key, KeyGroup, Node

DTYPE_NAMES = ("fp32", "bf16", "fp16")
"""The values of every ``dtype`` key; `mtune.training.memory.precision.DTYPES` maps them to torch dtypes."""

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
"""The linears ``lora.modules`` may name (Hugging Face's module names)."""

WEIGHT_STORAGE_DTYPES = ("float8_e4m3fn", "float8_e5m2")
"""The values of ``weight_storage_dtype`` (torch dtype names), besides null."""

ACTIVATION_CHECKPOINTING_POLICIES = ("block", "selective_op")
"""The values of ``activation_checkpointing_policy``."""

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

# ---- optimizer-state offload and weight group offloading ---------------------------------------------
OPTIMIZER_OFFLOAD_TARGETS = ("cpu",)
WEIGHT_OFFLOADING_TYPES = ("block_level", "leaf_level")

WEIGHT_OFFLOADING = Node(
    "weight_offloading",
    "frozen weights wait in host memory; each group of blocks (or each leaf module) is copied to the compute device "
    "just before it runs and freed after, in forward, backward and recomputation (null: off)",
    keys=KeyGroup(
        "weight_offloading",
        [
            Key("type", str, "block_level", "block_level: groups of blocks_per_group transformer blocks; leaf_level: "
                "each module holding weights on its own (least memory, most transfers)",
                choices=WEIGHT_OFFLOADING_TYPES),
            Key("blocks_per_group", int, 1, "block_level: transformer blocks copied in together", at_least=1),
            Key("use_streams", bool, True, "prefetch the next group while the current one computes (twice the groups "
                "on the device): on CUDA on a side stream from pinned memory; elsewhere in line, no overlap"),
        ],
    ),
)
"""``weight_offloading``: read by the training recipes (through `MEMORY_KEYS`) and by ``generate``; one declaration."""
# ---------------------------------------------------------------------------------------------------------------

MEMORY_KEYS = KeyGroup(
    "memory",
    help="techniques that trade compute or transfers for memory, and compile",
    keys=[
        Key("enable_activation_checkpointing", bool, False, "recompute block activations in the backward pass"),
        Key("activation_checkpointing_every_n_layers", int, 1, "checkpoint every Nth transformer block", at_least=1),
        Key("enable_activation_offloading", bool, False, "move saved activations to CPU memory until backward"),
        Key("activation_offloading_use_streams", bool, True, "overlap offloading transfers with compute (CUDA only)"),
        Key("optimizer_in_bwd", bool, False, "step each parameter's optimizer during backward and free its gradient"),
        Key("compile", bool, False, "torch.compile each transformer block (faster steps after a slow first one)"),
        Key("optimizer_offload", str, None, "cpu: optimizer states in host memory, gradients moved there during "
            "backward, the optimizer step on the CPU (ZeRO-Offload style; torch.optim.AdamW only; null: off)",
            choices=OPTIMIZER_OFFLOAD_TARGETS),
        WEIGHT_OFFLOADING,
        # fp8 weight storage and op-level selective checkpointing
        Key("weight_storage_dtype", str, None,
            "store the frozen linear weights inside the blocks in this fp8 format (one fp32 scale per output row) "
            "and upcast each to the compute dtype just before use; LoRA recipes only (null: as dtype)",
            choices=WEIGHT_STORAGE_DTYPES),
        Key("weight_storage_skip_patterns", list, [],
            "fnmatch globs on module names (model.layers.0.* or layers.0.*) whose weights keep the model dtype"),
        Key("activation_checkpointing_policy", str, "block",
            "block: recompute each checkpointed block whole; selective_op: keep the matmul and attention outputs "
            "and recompute only the cheap ops between them", choices=ACTIVATION_CHECKPOINTING_POLICIES),
    ],
)


def _default(group: KeyGroup, name: str) -> Any:
    return next(key.default for key in group.keys if key.name == name)


@dataclass(frozen=True)
class MemoryConfig:
    """The `MEMORY_KEYS` of a run, typed and under their YAML names, built once by :meth:`from_config` and passed to
    the code that acts on them (`mtune.training.memory.apply.apply_memory_techniques`, `build_optimizer`).
    Defaults are the declarations' own; left out, every technique is off."""

    enable_activation_checkpointing: bool = _default(MEMORY_KEYS, "enable_activation_checkpointing")
    activation_checkpointing_every_n_layers: int = _default(MEMORY_KEYS, "activation_checkpointing_every_n_layers")
    enable_activation_offloading: bool = _default(MEMORY_KEYS, "enable_activation_offloading")
    activation_offloading_use_streams: bool = _default(MEMORY_KEYS, "activation_offloading_use_streams")
    optimizer_in_bwd: bool = _default(MEMORY_KEYS, "optimizer_in_bwd")
    compile: bool = _default(MEMORY_KEYS, "compile")
    optimizer_offload: str | None = _default(MEMORY_KEYS, "optimizer_offload")
    weight_offloading: "WeightOffloading | None" = _default(MEMORY_KEYS, "weight_offloading")
    weight_storage_dtype: str | None = _default(MEMORY_KEYS, "weight_storage_dtype")
    weight_storage_skip_patterns: tuple[str, ...] = tuple(_default(MEMORY_KEYS, "weight_storage_skip_patterns"))
    activation_checkpointing_policy: str = _default(MEMORY_KEYS, "activation_checkpointing_policy")

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> "MemoryConfig":
        """Read every field from a config whose defaults the recipe's schema has filled in (as ``mtune run`` does)."""
        missing = [f.name for f in fields(cls) if f.name not in cfg]
        if missing:
            raise KeyError(f"the config lacks {missing}: fill it with the recipe's SCHEMA.fill_defaults first")
        values = {f.name: cfg[f.name] for f in fields(cls)}
        values["weight_offloading"] = WeightOffloading.from_node(values["weight_offloading"])
        values["weight_storage_skip_patterns"] = tuple(values["weight_storage_skip_patterns"] or ())
        return cls(**values)


@dataclass(frozen=True)
class WeightOffloading:
    """The ``weight_offloading`` node, typed (`mtune.training.memory.weight_offloading` acts on it)."""

    type: str = _default(WEIGHT_OFFLOADING.keys, "type")
    blocks_per_group: int = _default(WEIGHT_OFFLOADING.keys, "blocks_per_group")
    use_streams: bool = _default(WEIGHT_OFFLOADING.keys, "use_streams")

    @classmethod
    def from_node(cls, node: Mapping[str, Any] | "WeightOffloading" | None) -> "WeightOffloading | None":
        """None stays None (off); a mapping's left-out keys take their declared defaults."""
        if node is None or isinstance(node, WeightOffloading):
            return node
        return cls(**{f.name: node[f.name] for f in fields(cls) if f.name in node})


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
                    Key("max_seq_len", int, None, "truncate samples to this many tokens (null: no limit)", at_least=1),
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
                    Key("modules", list, ["q_proj", "v_proj"], "linears to adapt: " + " ".join(LORA_TARGETS)),
                    Key("rank", int, 8, "adapter rank r", at_least=1),
                    Key("alpha", float, 16.0, "scale numerator: the update is scaled by alpha / rank", above=0),
                    Key("dropout", float, 0.0, "dropout on the adapter input", at_least=0, below=1),
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


DISTRIBUTED_KEYS = KeyGroup(
    "distributed",
    help="sharding with FSDP2 across devices and machines (launch with mtune run --nproc_per_node N ...)",
    keys=[
        Key("distributed_backend", str, None, "process-group backend (null: nccl on CUDA, gloo on CPU)"),
        Key("fsdp_reshard_after_forward", bool, True,
            "true: free gathered weights after each block's forward (ZeRO-3-like, least memory); false: keep them "
            "until backward (ZeRO-2-like, less communication)"),
        Key("fsdp_cpu_offload", bool, False,
            "keep parameters, gradients and optimizer state in CPU memory; the optimizer steps on the CPU"),
    ],
)


# ------------------------------------------------------------------------------------------------------ merge_lora
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


# ------------------------------------------------------------------------------------------------------ generate
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
        WEIGHT_OFFLOADING,
    ],
)

"""Qwen3.5's ``config.json``: the text model alone (``qwen3_5_text``, ``Qwen3_5ForCausalLM``) or the text tower of
the multimodal checkpoints the hub publishes (``qwen3_5``, ``Qwen3_5ForConditionalGeneration``, fields under
``text_config``), and the same two of Qwen3.5-MoE (``qwen3_5_moe_text`` / ``qwen3_5_moe``, ``Qwen3_5Moe*``).
RoPE fields are read from ``rope_parameters`` (transformers 5) or ``rope_scaling`` + top-level ``rope_theta`` /
``partial_rotary_factor`` (4.x style); the multimodal position sections (``mrope_section``) change
nothing for text, whose three position streams are equal.
"""

from mtune.models.qwen3_5 import Qwen3_5Args, hybrid_layer_types

# Qwen3_5TextConfig's defaults (transformers 5.24), which a text_config may omit.
TEXT_DEFAULTS = dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                     num_attention_heads=16, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
                     max_position_embeddings=32768, tie_word_embeddings=False, hidden_act="silu",
                     linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                     linear_num_key_heads=16, linear_num_value_heads=32, full_attention_interval=4)


# Qwen3_5MoeTextConfig's defaults (transformers 5.24) where they differ: 35B-A3B's shape.
MOE_TEXT_DEFAULTS = dict(TEXT_DEFAULTS, hidden_size=2048, num_hidden_layers=40, num_key_value_heads=2,
                         num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                         shared_expert_intermediate_size=512, router_aux_loss_coef=0.001, output_router_logits=False)
MOE_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")


def text_config(config: dict) -> dict:
    defaults = MOE_TEXT_DEFAULTS if config.get("model_type") in MOE_MODEL_TYPES else TEXT_DEFAULTS
    if config.get("model_type") in ("qwen3_5", "qwen3_5_moe"):
        return {**defaults, "tie_word_embeddings": config.get("tie_word_embeddings", False),
                **(config.get("text_config") or {})}
    return {**defaults, **config}


def qwen3_5_args(config: dict) -> Qwen3_5Args:
    """The text model of a ``qwen3_5_text`` / ``qwen3_5`` (or the MoE twins') config dict; one-line ``ValueError``
    for what mtune does not implement."""
    c = text_config(config)
    if c["hidden_act"] != "silu":
        raise ValueError(f"qwen3_5 hidden_act {c['hidden_act']!r} is not supported (only 'silu')")
    if c.get("attention_bias"):
        raise ValueError("qwen3_5 with attention_bias=true is not supported (the published models have none)")
    rope = {**(c.get("rope_scaling") or {}), **(c.get("rope_parameters") or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in (None, "default"):
        raise ValueError(f"qwen3_5 rope_type {rope_type!r} is not supported (only 'default')")
    n_layers = c["num_hidden_layers"]
    moe = {}
    if config.get("model_type") in MOE_MODEL_TYPES:
        moe = dict(n_experts=c["num_experts"], top_k=c["num_experts_per_tok"],
                   moe_intermediate_dim=c["moe_intermediate_size"],
                   shared_expert_intermediate_dim=c["shared_expert_intermediate_size"],
                   router_aux_loss_coef=float(c["router_aux_loss_coef"]),
                   output_router_logits=bool(c["output_router_logits"]))
    return Qwen3_5Args(
        **moe,
        vocab_size=c["vocab_size"], dim=c["hidden_size"], n_layers=n_layers, n_heads=c["num_attention_heads"],
        n_kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"], intermediate_dim=c["intermediate_size"],
        norm_eps=c["rms_norm_eps"], rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000000.0))),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25))),
        max_seq_len=c["max_position_embeddings"], tie_embeddings=bool(c["tie_word_embeddings"]),
        layer_types=list(c.get("layer_types") or hybrid_layer_types(n_layers, c["full_attention_interval"])),
        linear_n_k_heads=c["linear_num_key_heads"], linear_n_v_heads=c["linear_num_value_heads"],
        linear_k_head_dim=c["linear_key_head_dim"], linear_v_head_dim=c["linear_value_head_dim"],
        linear_conv_kernel=c["linear_conv_kernel_dim"])


def qwen3_5_hf_config(args: Qwen3_5Args, dtype: str) -> dict:
    """A text-only ``Qwen3_5ForCausalLM`` (``Qwen3_5MoeForCausalLM`` with experts) config.json (RoPE in both
    layouts)."""
    moe = {}
    if args.n_experts:
        moe = {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
               "num_experts": args.n_experts, "num_experts_per_tok": args.top_k,
               "moe_intermediate_size": args.moe_intermediate_dim,
               "shared_expert_intermediate_size": args.shared_expert_intermediate_dim,
               "router_aux_loss_coef": args.router_aux_loss_coef, "output_router_logits": args.output_router_logits}
    return {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": args.vocab_size,
        "hidden_size": args.dim, "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim, "intermediate_size": args.intermediate_dim,
        "hidden_act": "silu", "rms_norm_eps": args.norm_eps, "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings, "attention_bias": False, "layer_types": list(args.layer_types),
        "linear_num_key_heads": args.linear_n_k_heads, "linear_num_value_heads": args.linear_n_v_heads,
        "linear_key_head_dim": args.linear_k_head_dim, "linear_value_head_dim": args.linear_v_head_dim,
        "linear_conv_kernel_dim": args.linear_conv_kernel,
        "rope_theta": args.rope_theta, "partial_rotary_factor": args.partial_rotary_factor,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta,
                            "partial_rotary_factor": args.partial_rotary_factor},
        "torch_dtype": dtype,
        **moe,
    }

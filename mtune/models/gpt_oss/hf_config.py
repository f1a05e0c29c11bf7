"""gpt-oss's ``config.json`` in the layouts it is published and saved in: the hub's (transformers 4.55: ``rope_theta``
beside ``rope_scaling``, ``num_local_experts``, an MXFP4 ``quantization_config``) and transformers 5's
(``rope_parameters`` holding the theta). mtune writes both RoPE fields, so either version reads what it saves, and no
``quantization_config``: what it saves is dequantized.
"""

from mtune.models.gpt_oss import FULL, SLIDING, GptOssArgs, alternating_layer_types

_ROPE_KEYS = ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings", "truncate")


def _rope(config: dict) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling)`` from either layout; YaRN's fields kept (``truncate`` defaults to true, as in
    transformers), plain RoPE as None."""
    params = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    theta = float(params.get("rope_theta", config.get("rope_theta", 150000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "yarn":
        raise ValueError(f"gpt_oss rope_type {rope_type!r} is not supported ('yarn' and 'default' are)")
    scaling = {"rope_type": "yarn", **{k: params[k] for k in _ROPE_KEYS if params.get(k) is not None}}
    if "factor" not in scaling:
        scaling["factor"] = config["max_position_embeddings"] / scaling["original_max_position_embeddings"]
    for key in ("mscale", "mscale_all_dim", "attention_factor"):
        if params.get(key) is not None:
            scaling[key] = params[key]
    return theta, scaling


def gpt_oss_args(config: dict) -> GptOssArgs:
    """The model of a ``gpt_oss`` config dict; a one-line ``ValueError`` for what mtune does not load (other
    quantizations than the hub's MXFP4, unbiased attention, other RoPE types)."""
    quantization = (config.get("quantization_config") or {}).get("quant_method")
    if quantization not in (None, "mxfp4"):
        raise ValueError(f"gpt_oss with quantization_config {quantization!r} is not supported (mtune reads bf16 "
                         "or fp32 experts, and the hub's MXFP4 ones, dequantized as they load)")
    if not config.get("attention_bias", True):
        raise ValueError("gpt_oss with attention_bias=false is not supported (every published gpt-oss has biases)")
    n_layers = config["num_hidden_layers"]
    types = list(config.get("layer_types") or alternating_layer_types(n_layers))
    theta, scaling = _rope(config)
    n_heads = config["num_attention_heads"]
    return GptOssArgs(
        vocab_size=config["vocab_size"], dim=config["hidden_size"], n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // n_heads,
        intermediate_dim=config["intermediate_size"], norm_eps=config.get("rms_norm_eps", 1e-5), rope_theta=theta,
        rope_scaling=scaling, max_seq_len=config.get("max_position_embeddings", 131072),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)), sliding_window=config.get("sliding_window"),
        layer_types=types, n_experts=config.get("num_local_experts", config.get("num_experts")),
        top_k=config.get("num_experts_per_tok", config.get("experts_per_token")),
        swiglu_alpha=float(config.get("swiglu_alpha", 1.702)), swiglu_limit=float(config.get("swiglu_limit", 7.0)),
        router_aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)),
        output_router_logits=bool(config.get("output_router_logits", False)))


def gpt_oss_hf_config(args: GptOssArgs, dtype: str) -> dict:
    """A ``GptOssForCausalLM`` config.json (no quantization) that transformers 4.x and 5.x read as the same model."""
    rope = dict(args.rope_scaling or {"rope_type": "default"})
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": args.vocab_size,
        "hidden_size": args.dim, "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim, "intermediate_size": args.intermediate_dim,
        "hidden_act": "silu", "rms_norm_eps": args.norm_eps, "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings, "sliding_window": args.sliding_window,
        "layer_types": list(args.layer_types), "num_local_experts": args.n_experts,
        "num_experts_per_tok": args.top_k, "swiglu_alpha": args.swiglu_alpha, "swiglu_limit": args.swiglu_limit,
        "router_aux_loss_coef": args.router_aux_loss_coef, "output_router_logits": args.output_router_logits,
        "attention_bias": True, "rope_theta": args.rope_theta, "rope_scaling": args.rope_scaling,
        "rope_parameters": {**rope, "rope_theta": args.rope_theta}, "dtype": dtype,
    }


__all__ = ["gpt_oss_args", "gpt_oss_hf_config", "SLIDING", "FULL"]

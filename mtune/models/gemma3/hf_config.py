"""Gemma 3's ``config.json`` in both layouts it was published with, text-only (``gemma3_text``,
``Gemma3ForCausalLM``) or the text tower of the multimodal model (``gemma3``, ``Gemma3ForConditionalGeneration``,
whose ``text_config`` leaves out what equals ``Gemma3TextConfig``'s defaults).

transformers 4.x (the hub's files): ``rope_theta`` + ``rope_scaling`` for the global layers, ``rope_local_base_freq``
for the sliding ones, ``sliding_window_pattern``; 5.x: ``rope_parameters`` keyed by layer type and ``layer_types``.
"""

from mtune.models.gemma3 import FULL, SLIDING, Gemma3Args, layer_types

# Gemma3TextConfig's defaults, which the multimodal checkpoints' text_config omits.
TEXT_DEFAULTS = dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
                     rope_theta=1000000.0, rope_local_base_freq=10000.0, query_pre_attn_scalar=256,
                     sliding_window=4096, sliding_window_pattern=6, max_position_embeddings=131072,
                     hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)


def text_config(config: dict) -> dict:
    """The text model's fields: ``config`` itself (``gemma3_text``) or its ``text_config`` over the defaults."""
    if config.get("model_type") == "gemma3":
        return {**TEXT_DEFAULTS, "tie_word_embeddings": config.get("tie_word_embeddings", True),
                **(config.get("text_config") or {})}
    return {**TEXT_DEFAULTS, **config}


def _rope(params: dict | None, theta: float) -> tuple[float, dict | None]:
    params = dict(params or {})
    theta = float(params.get("rope_theta", theta))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "linear":
        raise ValueError(f"gemma3 rope_type {rope_type!r} is not supported ('default' and 'linear' are)")
    return theta, {"rope_type": "linear", "factor": float(params["factor"])}


def gemma3_args(config: dict) -> Gemma3Args:
    """The text model of a ``gemma3_text`` or ``gemma3`` config dict; one-line ``ValueError`` for what mtune does
    not implement."""
    c = text_config(config)
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if c.get(key) is not None:
            raise ValueError(f"gemma3 with {key}={c[key]} is not supported (Gemma 3 has none)")
    if c.get("use_bidirectional_attention") or c.get("attention_bias"):
        raise ValueError("gemma3 with use_bidirectional_attention or attention_bias is not supported")
    act = c.get("hidden_activation") or c.get("hidden_act")
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"gemma3 hidden_activation {act!r} is not supported (only 'gelu_pytorch_tanh')")
    per_type = c.get("rope_parameters") or {}
    if FULL in per_type or SLIDING in per_type:  # transformers 5
        theta, scaling = _rope(per_type.get(FULL), c["rope_theta"])
        local, _ = _rope(per_type.get(SLIDING), c["rope_local_base_freq"])
    else:
        theta, scaling = _rope(c.get("rope_scaling"), c["rope_theta"])
        local = float(c["rope_local_base_freq"])
    n_layers = c["num_hidden_layers"]
    types = list(c.get("layer_types") or layer_types(n_layers, c["sliding_window_pattern"]))
    return Gemma3Args(
        vocab_size=c["vocab_size"], dim=c["hidden_size"], n_layers=n_layers, n_heads=c["num_attention_heads"],
        n_kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"], intermediate_dim=c["intermediate_size"],
        norm_eps=c["rms_norm_eps"], rope_theta=theta, rope_scaling=scaling, rope_local_theta=local,
        max_seq_len=c["max_position_embeddings"], tie_embeddings=bool(c["tie_word_embeddings"]),
        sliding_window=c["sliding_window"], query_pre_attn_scalar=float(c["query_pre_attn_scalar"]),
        layer_types=types)


def _number(value: float) -> int | float:
    return int(value) if float(value).is_integer() else value  # transformers types this field int


def gemma3_hf_config(args: Gemma3Args, dtype: str) -> dict:
    """A text-only ``Gemma3ForCausalLM`` config.json in both layouts (4.x and 5.x read it as the same model)."""
    full = {"rope_type": "default", **(args.rope_scaling or {}), "rope_theta": args.rope_theta}
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": args.vocab_size,
        "hidden_size": args.dim, "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim, "intermediate_size": args.intermediate_dim,
        "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len, "tie_word_embeddings": args.tie_embeddings,
        "sliding_window": args.sliding_window, "query_pre_attn_scalar": _number(args.query_pre_attn_scalar),
        "layer_types": list(args.layer_types), "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "rope_theta": args.rope_theta, "rope_scaling": args.rope_scaling, "rope_local_base_freq": args.rope_local_theta,
        "rope_parameters": {FULL: full, SLIDING: {"rope_type": "default", "rope_theta": args.rope_local_theta}},
        "torch_dtype": dtype,
    }

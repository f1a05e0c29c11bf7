"""Gemma 4's ``config.json`` in the layouts it is published and saved in: text-only (``gemma4_text``,
``Gemma4ForCausalLM``) or the text tower of the multimodal checkpoints (``gemma4``, ``Gemma4ForConditionalGeneration``,
under ``text_config``, defaults omitted or not).

The hub's files give the global layers' shape as ``global_head_dim`` and ``num_global_key_value_heads`` (the latter
used only where ``attention_k_eq_v``); transformers 5.24 saves it per layer instead (``per_layer_config``: layer index
-> ``head_dim``, ``num_key_value_heads``). Both read as the same model; mtune writes the hub's.
"""

from mtune.models.gemma4 import FULL, SLIDING, Gemma4Args, layer_types

# Gemma4TextConfig's defaults (transformers 5.24), for a text_config that leaves fields out.
TEXT_DEFAULTS = dict(vocab_size=262144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                     max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=True, sliding_window=512,
                     final_logit_softcapping=None, vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256,
                     attention_k_eq_v=False, num_kv_shared_layers=0, enable_moe_block=False, use_double_wide_mlp=False,
                     global_head_dim=512, num_global_key_value_heads=None)
_DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                 FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0}}


def text_config(config: dict) -> dict:
    """The text model's fields over :data:`TEXT_DEFAULTS`: ``config`` itself (``gemma4_text``) or its
    ``text_config`` (``gemma4``, whose top-level ``tie_word_embeddings`` counts)."""
    if config.get("model_type") == "gemma4":
        return {**TEXT_DEFAULTS, "tie_word_embeddings": config.get("tie_word_embeddings", True),
                **(config.get("text_config") or {})}
    return {**TEXT_DEFAULTS, **config}


def _global_shape(c: dict, types: list[str]) -> tuple[int, int | None]:
    """``(global_head_dim, global KV heads or None)`` from ``per_layer_config`` or the hub's two fields."""
    per_layer = c.get("per_layer_config")
    if per_layer:
        overrides = {int(i): dict(v) for i, v in per_layer.items()}
        sliding = sorted(i for i in overrides if types[i] == SLIDING and overrides[i])
        shapes = {(v.get("head_dim", c["head_dim"]), v.get("num_key_value_heads"))
                  for i, v in overrides.items() if types[i] == FULL}
        if sliding or len(shapes) > 1 or set(overrides) != {i for i, t in enumerate(types) if t == FULL}:
            raise ValueError("gemma4 per_layer_config must give every full_attention layer the same head_dim and "
                             "num_key_value_heads and no sliding layer anything")
        return shapes.pop()
    heads = c.get("num_global_key_value_heads") if c.get("attention_k_eq_v") else None
    return c["global_head_dim"], heads


def gemma4_args(config: dict) -> Gemma4Args:
    """The text model of a ``gemma4_text`` or ``gemma4`` config dict (the dense sizes and, with
    ``enable_moe_block``, the mixture of experts); a one-line ``ValueError`` for what mtune does not implement
    (bidirectional attention, biases)."""
    c = text_config(config)
    moe = {}
    if c.get("enable_moe_block"):
        missing = [k for k in ("num_experts", "top_k_experts", "moe_intermediate_size") if not c.get(k)]
        if missing:
            raise ValueError(f"gemma4 with enable_moe_block=true needs {', '.join(missing)}")
        moe = dict(n_experts=c["num_experts"], top_k=c["top_k_experts"],
                   moe_intermediate_dim=c["moe_intermediate_size"])
    if c.get("use_bidirectional_attention") or c.get("attention_bias"):
        raise ValueError("gemma4 with use_bidirectional_attention or attention_bias is not supported")
    act = c.get("hidden_activation")
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"gemma4 hidden_activation {act!r} is not supported (only 'gelu_pytorch_tanh')")
    n_layers = c["num_hidden_layers"]
    types = list(c.get("layer_types") or layer_types(n_layers))
    if len(types) != n_layers:
        raise ValueError(f"gemma4 layer_types has {len(types)} entries for {n_layers} layers")
    types[-1] = FULL  # transformers makes the last layer global whatever the file says
    rope = {**_DEFAULT_ROPE, **(c.get("rope_parameters") or {})}
    for kind, want in ((SLIDING, "default"), (FULL, "proportional")):
        if rope[kind].get("rope_type", "default") != want or rope[kind].get("factor", 1.0) != 1.0:
            raise ValueError(f"gemma4 {kind} rope_parameters {rope[kind]} are not supported ({want!r} RoPE "
                             "without a factor is)")
    global_head_dim, global_kv = _global_shape(c, types)
    per_layer_dim = c.get("hidden_size_per_layer_input") or 0
    return Gemma4Args(
        **moe,
        vocab_size=c["vocab_size"], dim=c["hidden_size"], n_layers=n_layers, n_heads=c["num_attention_heads"],
        n_kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"], intermediate_dim=c["intermediate_size"],
        norm_eps=c["rms_norm_eps"], rope_theta=float(rope[FULL]["rope_theta"]),
        rope_local_theta=float(rope[SLIDING]["rope_theta"]),
        partial_rotary_factor=float(rope[FULL].get("partial_rotary_factor", 1.0)),
        max_seq_len=c["max_position_embeddings"], tie_embeddings=bool(c["tie_word_embeddings"]),
        sliding_window=c["sliding_window"], layer_types=types, global_head_dim=global_head_dim,
        global_n_kv_heads=global_kv, keys_are_values=bool(c["attention_k_eq_v"]), per_layer_dim=per_layer_dim,
        per_layer_vocab_size=c["vocab_size_per_layer_input"], n_kv_shared_layers=c["num_kv_shared_layers"],
        double_wide_mlp=bool(c["use_double_wide_mlp"]), final_logit_softcap=c.get("final_logit_softcapping"))


def gemma4_hf_config(args: Gemma4Args, dtype: str) -> dict:
    """A text-only ``Gemma4ForCausalLM`` config.json in the hub's layout (``global_head_dim``,
    ``num_global_key_value_heads``), which transformers 5.24 reads as the same model."""
    return {
        "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "vocab_size": args.vocab_size,
        "hidden_size": args.dim, "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim, "intermediate_size": args.intermediate_dim,
        "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len, "tie_word_embeddings": args.tie_embeddings,
        "sliding_window": args.sliding_window, "layer_types": list(args.layer_types),
        "final_logit_softcapping": args.final_logit_softcap, "global_head_dim": args.global_head_dim,
        "num_global_key_value_heads": args.global_n_kv_heads, "attention_k_eq_v": args.keys_are_values,
        "hidden_size_per_layer_input": args.per_layer_dim, "vocab_size_per_layer_input": args.per_layer_vocab_size,
        "num_kv_shared_layers": args.n_kv_shared_layers, "use_double_wide_mlp": args.double_wide_mlp,
        "enable_moe_block": bool(args.n_experts), "num_experts": args.n_experts or None,
        "top_k_experts": args.top_k if args.n_experts else None,
        "moe_intermediate_size": args.moe_intermediate_dim if args.n_experts else None, "attention_bias": False,
        "rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": args.rope_local_theta},
                            FULL: {"rope_type": "proportional", "rope_theta": args.rope_theta,
                                   "partial_rotary_factor": args.partial_rotary_factor}},
        "dtype": dtype,
    }

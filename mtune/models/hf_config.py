"""Translate between Hugging Face ``config.json`` dicts and mtune's model arguments.

Reads the layouts several transformers versions write: ``rope_theta`` + ``rope_scaling`` (4.x) or
``rope_parameters`` (5.x), ``rope_scaling.type`` (older 4.x) or ``rope_type``, absent ``head_dim`` /
``num_key_value_heads`` (Llama 2 era configs), ``num_experts`` (4.x, the hub's Qwen3-MoE) or ``num_local_experts``
(5.x).
"""

from mtune.models.gemma3.hf_config import gemma3_args, gemma3_hf_config
from mtune.models.gemma4.hf_config import gemma4_args, gemma4_hf_config
from mtune.models.gpt_oss.hf_config import gpt_oss_args, gpt_oss_hf_config
from mtune.models.llama2 import Llama2Args
from mtune.models.llama3 import Llama3Args
from mtune.models.mistral import MistralArgs
from mtune.models.phi4 import Phi4Args, longrope
from mtune.models.qwen2 import Qwen2Args
from mtune.models.qwen3 import Qwen3Args
from mtune.models.qwen3_5.hf_config import qwen3_5_args, qwen3_5_hf_config
from mtune.models.qwen3_moe import Qwen3MoeArgs
from mtune.modules.transformer import DecoderArgs

_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                  "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe", "Phi3ForCausalLM": "phi3",
                  "Gemma3ForCausalLM": "gemma3_text", "Gemma3ForConditionalGeneration": "gemma3",
                  "Qwen3_5ForCausalLM": "qwen3_5_text", "Qwen3_5ForConditionalGeneration": "qwen3_5",
                  "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text", "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
                  "Gemma4ForCausalLM": "gemma4_text", "Gemma4ForConditionalGeneration": "gemma4",
                  "GptOssForCausalLM": "gpt_oss"}
_HF_MODEL_TYPE = {"llama2": "llama", "llama3": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                  "qwen3_moe": "qwen3_moe", "phi4": "phi3", "gemma3": "gemma3_text",
                  "qwen3_5": "qwen3_5_text", "gemma4": "gemma4_text", "gpt_oss": "gpt_oss"}  # Gemma 3 / 4, Qwen3.5: written text-only
_HF_ARCHITECTURE = {model_type: arch for arch, model_type in _ARCHITECTURES.items()}


# A multimodal checkpoint's text model (Gemma 3 4B-27B, Gemma 4, Qwen3.5) under the prefixes transformers 5 and 4.x
# write, and the towers mtune does not train (vision, Gemma 4's audio; Qwen3.5's multi-token-prediction layers).
_TEXT_TOWER = (("model.language_model.", "model."), ("language_model.model.", "model."),
               ("language_model.lm_head.", "lm_head."))
_OTHER_TOWERS = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.",
                 "model.visual.", "mtp.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")


def text_model_key(hf_key: str) -> str | None:
    """A checkpoint key as a text-only checkpoint writes it (``model.language_model.layers.0...`` ->
    ``model.layers.0...``), or None for a vision tower's or projector's (skipped)."""
    if hf_key.startswith(_OTHER_TOWERS):
        return None
    for prefix, replacement in _TEXT_TOWER:
        if hf_key.startswith(prefix):
            return replacement + hf_key.removeprefix(prefix)
    return hf_key


def _rope_params(config: dict) -> dict:
    """The RoPE fields of either layout in one dict (5.x ``rope_parameters`` over 4.x ``rope_scaling``)."""
    return {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}


def _rope(config: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either layout."""
    params = _rope_params(config)
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type == "longrope":
        original = params.get("original_max_position_embeddings") or config["original_max_position_embeddings"]
        stretch = params.get("factor") or config["max_position_embeddings"] / original
        scaling = longrope(params["short_factor"], params["long_factor"], original, stretch)
        if params.get("attention_factor") is not None:
            scaling["attention_factor"] = float(params["attention_factor"])
        return float(theta), scaling
    if rope_type != "llama3":
        raise ValueError(f"rope_type {rope_type!r} is not supported (mtune supports 'default', 'llama3' and "
                         "'longrope')")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return float(theta), {"rope_type": "llama3", **{k: params[k] for k in keys}}


def _moe_fields(config: dict) -> dict:
    """Qwen3-MoE's expert fields; absent optional ones take ``Qwen3MoeConfig``'s defaults (norm_topk_prob false,
    every layer sparse, aux loss off)."""
    n_experts = config.get("num_local_experts", config.get("num_experts"))
    if n_experts is None:
        raise KeyError("num_experts")
    return dict(
        n_experts=n_experts,
        top_k=config["num_experts_per_tok"],
        moe_intermediate_dim=config["moe_intermediate_size"],
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        decoder_sparse_step=config.get("decoder_sparse_step", 1),
        mlp_only_layers=list(config.get("mlp_only_layers") or []),
        router_aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)),
        output_router_logits=bool(config.get("output_router_logits", False)),
    )


def model_args_from_hf_config(config: dict) -> tuple[str, DecoderArgs]:
    """``(family, args)`` for a Hugging Face config dict; family is ``llama2``, ``llama3``, ``mistral``, ``qwen2``,
    ``qwen3``, ``qwen3_moe``, ``phi4``, ``gemma3``, ``qwen3_5``, ``gemma4`` or ``gpt_oss``.

    Raises ``ValueError`` (one line) for a model type or feature mtune does not implement.
    """
    model_type = config.get("model_type")
    if model_type is None:
        model_type = next((_ARCHITECTURES[a] for a in config.get("architectures") or [] if a in _ARCHITECTURES), None)
    if model_type not in _HF_ARCHITECTURE:
        found = model_type or config.get("architectures")
        raise ValueError(f"unsupported model_type {found!r}; mtune loads {', '.join(_HF_ARCHITECTURE)} checkpoints")
    quantization = (config.get("quantization_config") or {}).get("quant_method")
    if quantization is not None and model_type != "gpt_oss":  # gpt-oss: its MXFP4 experts, checked by gpt_oss_args
        raise ValueError(f"quantization_config {quantization!r} is not supported: its weights are stored quantized, "
                         "and mtune reads full-precision (bf16, fp16, fp32) checkpoints; use the unquantized model")
    if model_type in ("gemma3", "gemma3_text"):
        return "gemma3", gemma3_args(config)
    if model_type in ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"):
        return "qwen3_5", qwen3_5_args(config)
    if model_type in ("gemma4", "gemma4_text"):
        return "gemma4", gemma4_args(config)
    if model_type == "gpt_oss":
        return "gpt_oss", gpt_oss_args(config)
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (only 'silu')")
    if config.get("mlp_bias") or (model_type == "llama" and config.get("attention_bias")):
        raise ValueError("Llama checkpoints with mlp_bias or attention_bias are not supported")
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and config.get("use_sliding_window"):
        raise ValueError(f"{model_type} with use_sliding_window=true is not supported; set it to false")
    if model_type in ("qwen3", "qwen3_moe") and config.get("attention_bias"):
        raise ValueError("qwen3 with attention_bias=true is not supported (the published Qwen3 models have none)")
    theta, scaling = _rope(config)
    n_heads = config["num_attention_heads"]
    fields = dict(
        vocab_size=config["vocab_size"],
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // n_heads,
        intermediate_dim=config["intermediate_size"],
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=config.get("max_position_embeddings", 4096),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
    )
    if model_type == "qwen2":
        return "qwen2", Qwen2Args(**fields, qkv_bias=True)
    if model_type == "qwen3":
        return "qwen3", Qwen3Args(**fields)
    if model_type == "qwen3_moe":
        return "qwen3_moe", Qwen3MoeArgs(**fields, **_moe_fields(config))
    if model_type == "phi3":
        window = config.get("sliding_window")
        # Phi-4-mini rotates 3/4 of each head; Phi-4 (14B) the whole head, as Phi3Config's default of 1.0 does
        partial = _rope_params(config).get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        return "phi4", Phi4Args(**fields, partial_rotary_factor=float(partial),
                                # a window as long as the context changes nothing (Phi-4-mini's is 262144)
                                sliding_window=window if window and window < fields["max_seq_len"] else None)
    if model_type == "mistral":
        return "mistral", MistralArgs(**fields, sliding_window=config.get("sliding_window"))
    is_llama3 = fields["vocab_size"] >= 128000 or scaling is not None
    return ("llama3", Llama3Args(**fields)) if is_llama3 else ("llama2", Llama2Args(**fields))


def hf_config_from_model_args(args: DecoderArgs, dtype: str = "float32") -> dict:
    """A ``config.json`` dict that transformers loads as the same model (for saving without a source checkpoint)."""
    model_type = _HF_MODEL_TYPE.get(args.family)
    if model_type is None:
        raise ValueError(f"cannot write a Hugging Face config for model family {args.family!r}")
    if model_type == "gemma3_text":
        return gemma3_hf_config(args, dtype)
    if model_type == "qwen3_5_text":
        return qwen3_5_hf_config(args, dtype)
    if model_type == "gemma4_text":
        return gemma4_hf_config(args, dtype)
    if model_type == "gpt_oss":
        return gpt_oss_hf_config(args, dtype)
    rope = dict(args.rope_scaling or {"rope_type": "default"})
    config = {
        "architectures": [_HF_ARCHITECTURE[model_type]],
        "model_type": model_type,
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "intermediate_size": args.intermediate_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        # Both rope layouts, so transformers 4.x and 5.x read the same model.
        "rope_theta": args.rope_theta,
        "rope_scaling": args.rope_scaling,
        "rope_parameters": {**rope, "rope_theta": args.rope_theta},
        "torch_dtype": dtype,
    }
    if model_type == "mistral":
        config["sliding_window"] = args.sliding_window
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        config["use_sliding_window"] = False
    if model_type in ("qwen3", "qwen3_moe"):
        config["attention_bias"] = False
    if model_type == "qwen3_moe":
        # Both names of the expert count, so transformers 4.x (num_experts) and 5.x (num_local_experts) read it.
        config.update(num_experts=args.n_experts, num_local_experts=args.n_experts,
                      num_experts_per_tok=args.top_k, moe_intermediate_size=args.moe_intermediate_dim,
                      norm_topk_prob=args.norm_topk_prob, decoder_sparse_step=args.decoder_sparse_step,
                      mlp_only_layers=list(args.mlp_only_layers), router_aux_loss_coef=args.router_aux_loss_coef,
                      output_router_logits=args.output_router_logits)
    if model_type == "phi3":
        # pad_token_id: Phi3Config's default (32000) would lie outside a smaller vocabulary
        config.update(partial_rotary_factor=args.partial_rotary_factor, sliding_window=args.sliding_window,
                      pad_token_id=None)
        config["rope_parameters"]["partial_rotary_factor"] = args.partial_rotary_factor
        if args.rope_scaling:
            config["original_max_position_embeddings"] = args.rope_scaling["original_max_position_embeddings"]
    return config

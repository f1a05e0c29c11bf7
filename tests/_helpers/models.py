"""Tiny random Hugging Face model directories, written with transformers itself (the oracle for mtune's models)."""

from pathlib import Path

import torch

from mtune.models import build_model

# Shapes match mtune's ``tiny`` sizes: NF4-friendly (every linear's numel divisible by 32768), GQA 4/2 heads.
_TINY = dict(
    vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
)
_LLAMA3_SCALING = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64,
)
# Phi-4-mini's RoPE on the tiny shape: the first 48 of 64 features rotated, LongRoPE from a 64-token context to 512
# (the factors, 24 per set, equal mtune's tiny size's).
_PHI4_LONGROPE = dict(
    rope_type="longrope", short_factor=[1.0 + 0.1 * i for i in range(24)],
    long_factor=[2.0 + 0.5 * i for i in range(24)], original_max_position_embeddings=64, partial_rotary_factor=0.75,
)
FAMILY_CONFIGS = {
    "llama2": ("LlamaConfig", dict(rms_norm_eps=1e-5, rope_theta=10000.0)),
    "llama3_1": ("LlamaConfig", dict(rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING)),
    "llama3_2": ("LlamaConfig", dict(rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING,
                                     tie_word_embeddings=True)),
    "qwen2_5": ("Qwen2Config", dict(rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=8)),
    # 8 heads of 64 on a 256-wide model: head_dim independent of hidden_size / heads, as in every Qwen3 size.
    "qwen3": ("Qwen3Config", dict(rms_norm_eps=1e-6, rope_theta=1000000.0, num_attention_heads=8,
                                  num_key_value_heads=4, tie_word_embeddings=True)),
    # 6 layers: 5 sliding (window 8, RoPE base 1e4) and a global one (base 1e6 stretched x8); 1/sqrt(32) scores
    "gemma3": ("Gemma3TextConfig", dict(rms_norm_eps=1e-6, num_hidden_layers=6, sliding_window=8,
                                        query_pre_attn_scalar=32, rope_parameters={
                                            "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                               "rope_theta": 1000000.0},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                                        tie_word_embeddings=True, pad_token_id=0)),
    # 4 layers: Gated DeltaNet, gated attention, twice (4 value heads of 64 over 2 q/k heads); a quarter rotated
    "qwen3_5": ("Qwen3_5TextConfig", dict(rms_norm_eps=1e-6, rope_theta=10000000.0, num_hidden_layers=4,
                                          layer_types=["linear_attention", "full_attention"] * 2,
                                          linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                                          linear_value_head_dim=64, partial_rotary_factor=0.25,
                                          tie_word_embeddings=True, pad_token_id=0)),
    # 6 layers (sliding, global) x 3, window 8; global heads of 128 over 1 KV head with keys as values, a quarter of
    # their frequencies rotated; per-layer inputs of 128; the last two layers reuse layers 2 and 3's keys and values
    # with double-wide MLPs; logits soft-capped at 30 (mtune's gemma4 tiny size)
    "gemma4": ("Gemma4TextConfig", dict(rms_norm_eps=1e-6, num_hidden_layers=6, sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention"] * 3, global_head_dim=128,
                                        num_global_key_value_heads=1, attention_k_eq_v=True,
                                        hidden_size_per_layer_input=128, vocab_size_per_layer_input=512,
                                        num_kv_shared_layers=2, use_double_wide_mlp=True,
                                        final_logit_softcapping=30.0, tie_word_embeddings=True, pad_token_id=0)),
    # Gemma 4 26B-A4B's block (mtune's gemma4 tiny_moe size): 4 layers (sliding, global) x 2, window 8, global heads
    # of 128 over 1 KV head with keys as values; a dense MLP of 512 beside 8 experts of 128, 2 per token; no per-layer
    # inputs or shared KV; logits soft-capped at 30
    "gemma4_moe": ("Gemma4TextConfig", dict(rms_norm_eps=1e-6, num_hidden_layers=4, sliding_window=8,
                                            layer_types=["sliding_attention", "full_attention"] * 2,
                                            global_head_dim=128, num_global_key_value_heads=1, attention_k_eq_v=True,
                                            hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=8,
                                            top_k_experts=2, moe_intermediate_size=128, final_logit_softcapping=30.0,
                                            tie_word_embeddings=True, pad_token_id=0)),
    # 8 experts of 128 (NF4-friendly projections), 2 per token, renormalised as in every published Qwen3-MoE;
    # Qwen3's tiny attention.
    "qwen3_moe": ("Qwen3MoeConfig", dict(rms_norm_eps=1e-6, rope_theta=1000000.0, num_attention_heads=8,
                                         num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=128, norm_topk_prob=True)),
    # 8 experts of 128 (gate_up 256 x 256, down 256 x 128), 2 per token; a window of 8 on layer 0, full attention on
    # layer 1; YaRN x8 from a 64-token context (mtune's gpt_oss tiny size)
    "gpt_oss": ("GptOssConfig", dict(rms_norm_eps=1e-5, rope_theta=150000.0, intermediate_size=128,
                                     num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
                                     rope_scaling=dict(rope_type="yarn", factor=8.0, beta_fast=32.0, beta_slow=1.0,
                                                       truncate=False, original_max_position_embeddings=64))),
    "phi4": ("Phi3Config", dict(rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=_PHI4_LONGROPE,
                                original_max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=0)),
}


def tiny_hf_config(family: str, **overrides):
    """A transformers config of the tiny shape for ``family`` (one of ``FAMILY_CONFIGS``)."""
    import transformers

    cls_name, extra = FAMILY_CONFIGS[family]
    kwargs = {**_TINY, **extra, **overrides}
    if "rope_theta" in kwargs and hasattr(transformers, "LlamaConfig"):
        # transformers 5 folds rope_theta and rope_scaling into rope_parameters.
        params = dict(kwargs.pop("rope_scaling", None) or {"rope_type": "default"})
        params["rope_theta"] = kwargs.pop("rope_theta")
        kwargs["rope_parameters"] = params
    return getattr(transformers, cls_name)(**kwargs)


def tiny_hf_model(family: str, seed: int = 0, **overrides):
    """A seeded random transformers ``*ForCausalLM`` of the tiny shape, fp32, eager attention, in eval mode."""
    import transformers

    config = tiny_hf_config(family, **overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random norms and biases too, so parity checks cover them (they start as ones / zeros; Gemma's norms, which
    # scale by 1 + weight, as zeros; Qwen3.5's too, but for its DeltaNet output norm).
    def unit(name):
        return 0.0 if family == "gemma3" or (family == "qwen3_5" and "linear_attn.norm" not in name) else 1.0

    with torch.no_grad():
        for name, param in model.named_parameters():
            norm = name.endswith(("norm.weight", "norm_1.weight", "norm_2.weight"))  # Gemma 4 MoE's _1 / _2 too
            if norm or name.endswith((".bias", "_bias", ".sinks")):
                param.normal_(unit(name) if norm else 0.0, 0.1)
            elif name.endswith(("mlp.gate.weight", "router.proj.weight", "mlp.router.weight")):
                param.normal_(0.0, 0.5)  # transformers starts routers at zero (gpt-oss's near it): experts tied
            elif name.endswith(("router.scale", "router.per_expert_scale")):
                param.uniform_(0.5, 1.5)  # Gemma 4's router scales, ones at the start
        if family.startswith("gemma4"):
            # Gemma 4 leaves scores unscaled (queries and keys are normed): norm weights near 1 give random heads
            # scores of +-60, where fp32 round-off alone moves transformers' own eager and SDPA logits 5e-5 apart;
            # scaled by 0.3 they agree to 2.4e-6 (and mtune's logits are 1.8e-6 from either)
            for name, param in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    param.mul_(0.3)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's per-layer scalar (a buffer there), ones at the start
                buffer.uniform_(0.5, 1.5)
    return model.eval()


def write_tiny_hf_model(
    tmp_dir, family: str, sharded: bool = False, seed: int = 0, shard_size: str = "1MB", **overrides
) -> Path:
    """Write a tiny random model of ``family`` with ``save_pretrained`` into ``tmp_dir/<family>``; return the path.

    ``sharded=True`` splits the weights into safetensors files of at most ``shard_size`` with a
    ``model.safetensors.index.json``; ``overrides`` replace config fields (e.g. ``num_hidden_layers=4``).
    """
    model = tiny_hf_model(family, seed=seed, **overrides)
    out = Path(tmp_dir) / family
    model.save_pretrained(out, max_shard_size=shard_size if sharded else "1000GB")
    model.generation_config.save_pretrained(out)
    return out


def mtune_twin(hf_model, family, **overrides):
    """The mtune tiny model of ``family`` (``overrides`` of its arguments; ``gemma4_moe``: gemma4's ``tiny_moe``)
    holding ``hf_model``'s weights."""
    family, size = {"gemma4_moe": ("gemma4", "tiny_moe")}.get(family, (family, "tiny"))
    model = build_model(family, size, device="cpu", **overrides)
    state = {k.removeprefix("model."): v for k, v in hf_model.state_dict().items()}
    state = whole_expert_state(state) if family == "gpt_oss" else stacked_expert_state(state)
    if model.args.tie_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    return model.eval()


def stacked_expert_state(state: dict) -> dict:
    """A transformers 5 state dict with fused experts (``mlp.experts.gate_up_proj [E, 2h, d]``, ``down_proj [E, d,
    h]``; Gemma 4's ``experts.*``) in mtune's stacked layout (``mlp.experts.{gate,up}_proj.weight [E, h, d]``,
    ``down_proj.weight [E, d, h]``); other keys unchanged."""
    out = {}
    for key, value in state.items():
        prefix, _, leaf = key.rpartition(".")
        if not prefix.endswith("experts") or leaf not in ("gate_up_proj", "down_proj"):
            out[key] = value
        elif leaf == "down_proj":
            out[f"{prefix}.down_proj.weight"] = value
        else:
            out[f"{prefix}.gate_proj.weight"], out[f"{prefix}.up_proj.weight"] = value.chunk(2, dim=1)
    return out


def tiny_gemma4_multimodal(text_family: str = "gemma4", seed: int = 0):
    """A seeded random transformers ``Gemma4ForConditionalGeneration`` (the hub's layout: the text model under
    ``model.language_model.``, one-layer vision and audio towers beside it) whose text model is ``text_family``'s
    tiny config, with random norm weights in the text model, in eval mode."""
    import transformers

    gemma4 = transformers.models.gemma4
    vision = gemma4.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=2, head_dim=16, patch_size=4,
                                       position_embedding_size=64)
    audio = gemma4.Gemma4AudioConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     subsampling_conv_channels=[8, 4], output_proj_dims=32)
    config = gemma4.Gemma4Config(text_config=tiny_hf_config(text_family).to_dict(), vision_config=vision.to_dict(),
                                 audio_config=audio.to_dict(), boi_token_id=505, eoi_token_id=506,
                                 image_token_id=507, video_token_id=508, boa_token_id=509, eoa_token_index=510,
                                 audio_token_id=511)
    torch.manual_seed(seed)
    multimodal = gemma4.Gemma4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in multimodal.named_parameters():
            if "language_model" not in name:
                continue
            if name.endswith(("norm.weight", "norm_1.weight", "norm_2.weight")):
                param.normal_(0.3 if name.endswith(("q_norm.weight", "k_norm.weight")) else 1.0, 0.03)
            elif name.endswith("router.proj.weight"):
                param.normal_(0.0, 0.5)  # routing that depends on the token (transformers starts it near zero)
    return multimodal


def whole_expert_state(state: dict) -> dict:
    """gpt-oss's experts as transformers holds them (``mlp.experts.gate_up_proj [E, d, 2h]``, ``..._bias [E, 2h]``,
    ``down_proj [E, h, d]``) in mtune's ``[E, out, in]`` rows (``mlp.experts.gate_up_proj.weight`` / ``.bias``);
    other keys unchanged."""
    out = {}
    for key, value in state.items():
        prefix, _, leaf = key.rpartition(".")
        projection = leaf.removesuffix("_bias")
        if not prefix.endswith("mlp.experts") or projection not in ("gate_up_proj", "down_proj"):
            out[key] = value
        elif leaf.endswith("_bias"):
            out[f"{prefix}.{projection}.bias"] = value
        else:
            out[f"{prefix}.{projection}.weight"] = value.transpose(1, 2)
    return out


def load_hf_model(path):
    """transformers' ``*ForCausalLM`` of a saved checkpoint directory, fp32, in eval mode (the oracle's side)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def logits_of(model, tokens):
    """The logits of ``tokens`` [batch, seq] without gradients: an mtune model's tensor or transformers' ``.logits``."""
    with torch.no_grad():
        out = model(tokens)
    return out if isinstance(out, torch.Tensor) else out.logits

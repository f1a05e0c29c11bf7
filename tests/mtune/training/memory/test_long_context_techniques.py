"""The long-context techniques as registry techniques: ``mlp_tiles`` (the tiled MLP) and ``attention_kernel``
(segments or the dense mask), each through the schema, the rules, resume, application, ``--fit`` and the
out-of-memory advice; the tiled model against the untiled one (the oracle), ``auto`` included."""

import pytest
import torch
from omegaconf import OmegaConf

from mtune.config import RecipeSchema
from mtune.config.keys import MODEL_NODES, RUN_KEYS, TRAINING_NODES
from mtune.config.rules import RUN_RULES
from mtune.models import build_model
from mtune.modules.feed_forward import FeedForward
from mtune.modules.tiled_mlp import mlp_tiles, tile_count
from mtune.training.checkpointing.recipe_state import check_resume_compatible
from mtune.training.memory import phases, registry
from tests._helpers.training import apply_memory_techniques
from mtune.training.memory.oom import memory_advice
from mtune.training.memory.registry import TILED_MLP, MemoryConfig
from mtune.training.memory.technique import ModelFacts

SCHEMA = RecipeSchema([RUN_KEYS, registry.MEMORY_KEYS, MODEL_NODES, TRAINING_NODES],
                      rules=RUN_RULES + registry.MEMORY_RULES)


def _cfg(**changes):
    cfg = OmegaConf.create({"output_dir": "/nowhere", "model": {"family": "tiny", "size": "tiny"},
                            "tokenizer": {"path": None, "max_seq_len": 32}, "optimizer": {
                                "_component_": "torch.optim.AdamW", "lr": 1e-4},
                            "dataset": {"_component_": "mtune.data.instruct_dataset"}, **changes})
    return SCHEMA.fill_defaults(cfg)


def _facts(tokens, dim=256):
    return ModelFacts(n_layers=2, dim=dim, trainable_bytes=1.0, frozen_bytes=1.0, residual_bytes=2,
                      micro_batch_tokens=tokens, step_tokens=tokens)


def test_mlp_tiles_key_rules_and_resume():
    assert _cfg().mlp_tiles == 1 and MemoryConfig().mlp_tiles == 1  # off by default
    assert SCHEMA.check(_cfg(mlp_tiles=4)) == [] and SCHEMA.check(_cfg(mlp_tiles="auto")) == []
    assert any("mlp_tiles" in p for p in SCHEMA.check(_cfg(mlp_tiles=0)))
    assert any("mlp_tiles" in p for p in SCHEMA.check(_cfg(mlp_tiles="many")))
    selective = dict(enable_activation_checkpointing=True, activation_checkpointing_policy="selective_op")
    assert any("saves nothing under activation_checkpointing_policy=selective_op" in p
               for p in SCHEMA.check(_cfg(mlp_tiles="auto", **selective)))
    assert SCHEMA.check(_cfg(**selective)) == [] and SCHEMA.check(_cfg(mlp_tiles=2, compile=True)) == []
    saved = OmegaConf.to_container(_cfg(), resolve=True)
    check_resume_compatible(saved, dict(saved, mlp_tiles=8, attention_kernel="dense_mask"))  # lossless: may change
    assert phases.lossy(MemoryConfig.from_config(_cfg(mlp_tiles=8))) == []


def _tiled_mlp_choices(cfg, facts):
    memory = MemoryConfig.from_config(cfg)
    return TILED_MLP.fit_choices(memory[TILED_MLP], memory, facts)


def test_mlp_tiles_fit_choices_and_oom_advice():
    assert [c.overrides for c in _tiled_mlp_choices(_cfg(), _facts(256))] == [{"mlp_tiles": 1}]  # 1 tile: none
    choices = _tiled_mlp_choices(_cfg(), _facts(65536, dim=4096))
    assert [(c.level, c.overrides, c.lossy) for c in choices] == [(0, {"mlp_tiles": 1}, None),
                                                                  (1, {"mlp_tiles": 16}, None)]
    long = {"tokenizer": {"path": None, "max_seq_len": 16384}, "batch_size": 1}
    assert "mlp_tiles=auto" in memory_advice(_cfg(**long))
    assert "mlp_tiles=auto" not in memory_advice(_cfg())  # 4 x 32 tokens: the MLP is not what fills memory
    assert "mlp_tiles=auto" not in memory_advice(_cfg(mlp_tiles=4, **long))
    packed = {"dataset": {"_component_": "mtune.data.instruct_dataset", "packed": True}}
    assert memory_advice(_cfg(attention_kernel="dense_mask", **packed))[0] == "attention_kernel=auto"
    assert "attention_kernel=auto" not in memory_advice(_cfg(**packed))


def test_tile_count():
    assert [tile_count("auto", n, 256) for n in (1, 256, 257, 600, 65536)] == [1, 1, 2, 3, 256]
    assert [tile_count(4, n, 256) for n in (2, 600)] == [2, 4]
    assert MemoryConfig(mlp_tiles="auto")[TILED_MLP].tiles(600, 256) == 3


def _step(model, tokens):
    model.zero_grad()
    logits = model(tokens)
    logits.square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tiles, checkpointing", [("auto", False), (3, True)])
def test_applied_through_the_registry_equals_untiled(tiles, checkpointing):
    # 2 rows of 300 tokens on a model of width 256: auto runs 3 tiles of 200 tokens
    torch.manual_seed(0)
    lora = {"modules": ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"], "rank": 8, "alpha": 16}
    memory = MemoryConfig(enable_activation_checkpointing=checkpointing)
    plain = build_model("llama3_1", "tiny", device="cpu")
    tiled = build_model("llama3_1", "tiny", device="cpu")
    apply_memory_techniques(plain, memory, lora=lora)
    apply_memory_techniques(tiled, MemoryConfig(enable_activation_checkpointing=checkpointing, mlp_tiles=tiles),
                            lora=lora)
    tiled.load_state_dict(plain.state_dict())
    with torch.no_grad():  # B off zero, so A's gradient is not zero
        for p_plain, (name, p_tiled) in zip(plain.parameters(), tiled.named_parameters()):
            if name.endswith("lora_b.weight"):
                p_plain.normal_(0, 0.05)
                p_tiled.copy_(p_plain)
    mlps = [m for m in tiled.modules() if isinstance(m, FeedForward)]
    assert {mlp_tiles(m) for m in mlps} == {tiles} and {mlp_tiles(m, 600) for m in mlps} == {3}
    calls = []
    handles = [m.gate_proj.lora_a.register_forward_hook(lambda mod, i, o: calls.append(i[0].shape[-2]))
               for m in mlps[:1]]
    tokens = torch.randint(0, 512, (2, 300))
    ref, ref_grads = _step(plain, tokens)
    out, grads = _step(tiled, tokens)
    for h in handles:
        h.remove()
    assert set(calls) == {200}  # each MLP call ran 200-token tiles
    scale = out.abs().max().item()
    assert (out - ref).abs().max().item() <= 1e-5 * scale
    assert grads.keys() == ref_grads.keys() and grads
    for name, grad in grads.items():
        assert (grad - ref_grads[name]).abs().max().item() <= 1e-5 * ref_grads[name].abs().max().item(), name


def test_auto_leaves_a_short_micro_batch_untiled():
    model = build_model("llama3_1", "tiny", device="cpu")
    apply_memory_techniques(model, MemoryConfig(mlp_tiles="auto"))
    x = torch.randn(1, 200, 256, requires_grad=True)  # 200 tokens <= width 256: the plain forward
    y = model.layers[0].mlp(x)
    assert "_TiledMLP" not in type(y.grad_fn).__name__


def test_attention_kernel_key_reaches_the_model_and_the_log(caplog):
    assert _cfg().attention_kernel == "auto"
    assert any("attention_kernel" in p for p in SCHEMA.check(_cfg(attention_kernel="flex")))
    model = build_model("mistral", "tiny", device="cpu")
    with caplog.at_level("INFO", logger="mtune"):
        apply_memory_techniques(model, MemoryConfig(attention_kernel="segments"))
    assert model.attention_kernel == "segments"
    assert "attention_kernel=segments: packed rows run sdpa_per_segment on cpu" in caplog.text
    ids = torch.tensor([[0] * 10 + [1] * 22])
    pos = torch.cat([torch.arange(10), torch.arange(22)])[None]
    model(torch.randint(0, 512, (1, 32)), input_pos=pos, document_ids=ids)
    model.attention_kernel = "dense_mask"
    model(torch.randint(0, 512, (1, 32)), input_pos=pos, document_ids=ids)
    model(torch.randint(0, 512, (1, 4)))  # unpacked, shorter than the window: SDPA's causal path
    assert model.attention_kernels_run == {"sdpa_per_segment", "dense_mask", "sdpa_causal"}


def test_mlp_tiles_recompute_length_overrides_and_the_advice_threshold():
    """The FLOPs counter's recompute flag per block, the count written for one length or ``auto`` kept for any,
    and the advice from exactly LONG_MICRO_BATCH_TOKENS tokens per micro-batch on."""
    from mtune.training.memory.techniques.tiled_mlp import LONG_MICRO_BATCH_TOKENS

    auto = MemoryConfig(mlp_tiles="auto")
    settings = auto[TILED_MLP]
    assert TILED_MLP.footprint(settings, auto, _facts(256)).recompute.mlp_tiled == (False, False)  # 1 tile: none
    assert TILED_MLP.footprint(settings, auto, _facts(600)).recompute.mlp_tiled == (True, True)
    eight = MemoryConfig(mlp_tiles=8)
    assert TILED_MLP.length_overrides(eight[TILED_MLP], eight, _facts(600), any_length=True) == {"mlp_tiles": "auto"}
    assert TILED_MLP.length_overrides(settings, auto, _facts(600), any_length=True) == {}
    assert TILED_MLP.length_overrides(settings, auto, _facts(600), any_length=False) == {"mlp_tiles": 3}
    assert TILED_MLP.length_overrides(eight[TILED_MLP], eight, _facts(600), any_length=False) == {}
    at = {"tokenizer": {"path": None, "max_seq_len": LONG_MICRO_BATCH_TOKENS}, "batch_size": 1}
    below = {"tokenizer": {"path": None, "max_seq_len": LONG_MICRO_BATCH_TOKENS - 1}, "batch_size": 1}
    assert "mlp_tiles=auto" in memory_advice(_cfg(**at)) and "mlp_tiles=auto" not in memory_advice(_cfg(**below))

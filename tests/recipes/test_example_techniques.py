"""Two techniques added as docs/architecture.md says, each one package (tests/_helpers/techniques/) and one registry
line, with no other file touched: int8 storage of the frozen block linears (a load-time technique: its weight
phase, its save phase) and AdamW with bf16 states (an optimizer-side technique: its optimizer phase). The run,
resume, the planner and ``--fit`` see each of them. fp32 on CPU, the tiny model of the recipe tests."""

import pytest
import torch

from mtune._cli.catalog import find_recipe, load_recipe_module
from mtune._cli.run import load_and_check
from mtune.training.checkpointing.recipe_state import ResumeError
from mtune.training.memory import registry
from mtune.training.planning import cost, fit
from mtune.training.planning.candidates import registry_knobs
from mtune.training.planning.plan import plan_memory
from tests._helpers.recipes import TRAIN_CONFIG, losses, read_metrics, run_recipe_in_process, train_overrides
from tests._helpers.techniques.bf16_states import BF16_STATES
from tests._helpers.techniques.int8_storage import INT8_STORAGE

SCHEDULE = ["epochs=1", "max_steps_per_epoch=6", "save_every_n_steps=2"]


def _register(monkeypatch, technique, before):
    """The registry's one line: ``technique`` inserted before ``before``; the keys the recipes read follow."""
    at = registry.TECHNIQUES.index(before)
    techniques = registry.TECHNIQUES[:at] + (technique,) + registry.TECHNIQUES[at:]
    monkeypatch.setattr(registry, "TECHNIQUES", techniques)
    monkeypatch.setattr(registry, "MEMORY_KEYS", registry.memory_keys(techniques))  # the recipes' SCHEMA reads it


@pytest.fixture
def int8_registered(monkeypatch):
    # after the other storage techniques (it needs to know what LoRA froze), before weight offloading
    _register(monkeypatch, INT8_STORAGE, registry.WEIGHT_OFFLOADING)


@pytest.fixture
def bf16_registered(monkeypatch):
    # before optimizer_state, whose footprint names the state bytes of every other optimizer
    _register(monkeypatch, BF16_STATES, registry.OPTIMIZER_STATE)


def _run(tmp_path, checkpoint, data, name, *extra):
    return run_recipe_in_process("lora_single_device",
                                 train_overrides(tmp_path / name, checkpoint, data) + SCHEDULE + list(extra))


def _cfg(*overrides):
    return load_and_check(load_recipe_module(find_recipe("lora_single_device")), TRAIN_CONFIG,
                          ["output_dir=/nowhere", "model.checkpoint_dir=null", "model.family=llama3_1",
                           "model.size=tiny", "tokenizer.path=null", *overrides])


def _run_and_resume(tmp_path, checkpoint, data, key):
    """The run with ``key=true``, the same run resumed from step 2, and the run without the technique."""
    on = _run(tmp_path, checkpoint, data, "on", f"{key}=true")
    resumed = _run(tmp_path, checkpoint, data, "resumed", f"{key}=true", f"resume_from_checkpoint={on / 'step_2'}")
    off = _run(tmp_path, checkpoint, data, "off")
    assert [r["step"] for r in read_metrics(resumed)] == [3, 4, 5, 6]
    assert losses(resumed) == losses(on)[2:]  # bit for bit: the technique's state came back with the checkpoint
    with pytest.raises(ResumeError, match=key):  # it changes what a step computes: a resume must keep it
        _run(tmp_path, checkpoint, data, "toggled", f"resume_from_checkpoint={on / 'step_2'}")
    return losses(on), losses(off)


def test_int8_storage_is_run_resumed_planned_and_searched(int8_registered, tmp_path, tiny_checkpoint, tiny_data):
    on, off = _run_and_resume(tmp_path, tiny_checkpoint, tiny_data, "int8_base")
    # the forward reads int8 weights from the first step: not the fp32 numbers, within int8's rounding of them
    assert on[0] != off[0] and abs(on[0] - off[0]) < 2e-3 * off[0]
    assert on[-1] < 0.9 * on[0]  # and it trains

    # the planner: every frozen block linear at 1 byte a weight instead of fp32's 4, plus its fp32 scale per row
    plain, int8 = plan_memory(_cfg()), plan_memory(_cfg("int8_base=true"))
    frozen = [(o, i) for o, i in _block_linear_shapes()]
    assert plain.device["parameters"] - int8.device["parameters"] == sum(o * i * 3 for o, i in frozen)
    assert int8.device["buffers"] - plain.device["buffers"] == sum(o * 4 for o, _ in frozen)  # the scales
    # the cost model and --fit: 1 byte a frozen 2-D weight, and a lossy level of its knob
    facts, int8_facts = cost.model_facts(_cfg()), cost.model_facts(_cfg("int8_base=true"))
    assert facts.frozen_bytes - int8_facts.frozen_bytes == sum(o * i * 3 for o, i in frozen)  # the embedding: fp32
    knobs = {knob.name: knob for knob in registry_knobs()}
    assert [c.lossy for c in knobs["int8_base"].choices(_cfg())] == [None, "int8 base weights"]
    # a 2 MiB device: the tiny model's fp32 base (1.4 MiB) is worth storing in int8 there
    candidates = fit.search(_cfg(), None, device_memory=2 << 20, knobs=[knobs["int8_base"], knobs["micro_batch"]],
                            max_fits=0, max_plans=0)
    assert {c.cfg.int8_base for c in candidates} == {True, False}
    assert {c.lossy for c in candidates if c.cfg.int8_base} == {("int8 base weights",)}


def _block_linear_shapes():
    from mtune.models import model_args

    args = model_args("llama3_1", "tiny")
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    per_block = [(q, args.dim), (kv, args.dim), (kv, args.dim), (args.dim, q), (args.intermediate_dim, args.dim),
                 (args.intermediate_dim, args.dim), (args.dim, args.intermediate_dim)]
    return per_block * args.n_layers


def test_bf16_states_are_run_resumed_planned_and_searched(bf16_registered, tmp_path, tiny_checkpoint, tiny_data):
    on, off = _run_and_resume(tmp_path, tiny_checkpoint, tiny_data, "bf16_optimizer_states")
    # the first step's loss comes before any state; later steps read the bf16-rounded moments
    assert on[0] == off[0] and on[2] != off[2] and abs(on[2] - off[2]) < 1e-2 * off[2]
    assert on[-1] < 0.9 * on[0]

    cfg_off, cfg_on = _cfg(), _cfg("bf16_optimizer_states=true")
    numel = cost.model_facts(cfg_on).trainable_numel
    # the planner's floor: 4 bytes of state a trainable weight instead of AdamW's 8
    states = [next(v for k, v in cost.device_floor(c)[0].items() if k.startswith("optimizer states"))
              for c in (cfg_off, cfg_on)]
    assert states == [8 * numel, 4 * numel]
    # the plan builds the wrapper and steps it: two bf16 moments a weight, but while the largest adapter matrix
    # steps its fp32 moments replace its bf16 ones (4 more bytes a weight of it; step counts alike on both sides)
    plain, bf16 = plan_memory(cfg_off), plan_memory(cfg_on)
    largest = max(p.numel() for p in _adapter_shapes())
    assert plain.device["optimizer_state"] - bf16.device["optimizer_state"] == 4 * numel - 4 * largest
    knobs = {knob.name: knob for knob in registry_knobs()}
    # a 2 MiB device: 88 KiB of saved states is worth a technique there (over 2% of it)
    candidates = fit.search(cfg_off, None, device_memory=2 << 20,
                            knobs=[knobs["bf16_optimizer_states"], knobs["micro_batch"]], max_fits=0, max_plans=0)
    assert {c.cfg.bf16_optimizer_states for c in candidates} == {True, False}
    assert {c.lossy for c in candidates if c.cfg.bf16_optimizer_states} == {("bf16 optimizer states",)}


def _adapter_shapes():
    from mtune.models import build_model_from_args, model_args
    from mtune.modules.lora import apply_lora

    model = apply_lora(build_model_from_args(model_args("llama3_1", "tiny")), ["q_proj", "v_proj", "o_proj"],
                       rank=8, alpha=16)
    return [p for p in model.parameters() if p.requires_grad]


def test_the_optimizer_phase_keeps_states_in_bf16(bf16_registered):
    from mtune.training.memory.registry import MemoryConfig
    from mtune.training.optimizers import build_optimizer, inner_optimizers

    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(8, 4))
    twin = torch.nn.Parameter(weight.detach().clone())
    wrapped = build_optimizer({"_component_": "torch.optim.AdamW", "lr": 1e-2}, [weight],
                              MemoryConfig(bf16_optimizer_states=True))
    plain = torch.optim.AdamW([twin], lr=1e-2)
    for _ in range(3):
        for p, opt in ((weight, wrapped), (twin, plain)):
            p.grad = torch.ones_like(p)
            opt.step()
    [inner] = inner_optimizers(wrapped)  # one optimizer per parameter
    assert inner.state[weight]["exp_avg"].dtype == torch.bfloat16
    # bf16 moments round at 2^-8 relative: the update differs from fp32 AdamW's by about that share of lr
    assert not torch.equal(weight, twin) and torch.allclose(weight, twin, atol=3 * 2**-8 * 1e-2, rtol=0)

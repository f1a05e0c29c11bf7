"""`compile: true` is planned with the blocks compiled as a run compiles them, and the plan keeps what Inductor keeps.

The oracle is Inductor itself on the CPU: the bytes autograd saves for backward in one step of the same model, eager
and with every block compiled by ``block.compile()`` (the run's compile). On this config the plan's peak sits where
every saved tensor is alive, so the plan must lower its activations by exactly what Inductor saves less than eager.
Mutations seen failing: compile planned eagerly again (the difference planned is 0), the plan's blocks compiled by
Inductor as the run's (it crashes on fake tensors), and the recompile limits left at dynamo's (the last test)."""

import pytest
import torch

from mtune._cli.catalog import find_recipe, load_recipe_module
from mtune._cli.run import load_and_check
from mtune.training.loop import build_loss, forward_loss
from mtune.training.memory.registry import MemoryConfig
from mtune.training.model_setup import setup_model
from mtune.training.observe.memory_stats import saved_for_backward_bytes
from mtune.training.planning.plan import _batch, _model_source, plan_memory
from mtune.training.precision import storage_dtype
from tests._helpers.recipes import TRAIN_CONFIG, train_overrides

pytest.importorskip("torch._inductor")
NO_CHECKPOINTING = {"dataset.packed": True, "tokenizer.max_seq_len": 64, "dtype": "bf16",
                    "enable_activation_checkpointing": False}


def _config(tmp_path, checkpoint, data, **changes):
    overrides = train_overrides(tmp_path, checkpoint, data, **{**NO_CHECKPOINTING, **changes})
    return load_and_check(load_recipe_module(find_recipe("lora_single_device")), TRAIN_CONFIG, overrides)


def _saved_bytes_eager_and_compiled(cfg) -> tuple[int, int]:
    """What one step of ``cfg``'s model saves for backward (its planned batch), eager, then with every block
    compiled by Inductor as a run compiles it."""
    source = _model_source(cfg, None)
    model, _ = setup_model(source, device=torch.device("cpu"), dtype=storage_dtype(str(cfg.dtype)),
                           memory=MemoryConfig.from_config(cfg).replace(compile=False))
    torch.manual_seed(0)
    batch = _batch(cfg, source.args.vocab_size, 1)[0]
    loss_fn = build_loss(cfg.get("loss"))

    def step():
        forward_loss(model, batch, loss_fn)[0].backward()

    eager = saved_for_backward_bytes(step, model)
    for block in model.layers:
        block.compile()
    step()  # compile before measuring
    return eager, saved_for_backward_bytes(step, model)


def test_a_compiled_plan_saves_what_inductor_saves(tmp_path, tiny_checkpoint, tiny_data):
    eager_cfg = _config(tmp_path, tiny_checkpoint, tiny_data, compile=False)
    compiled_cfg = _config(tmp_path, tiny_checkpoint, tiny_data, compile=True)
    eager_plan, compiled_plan = plan_memory(eager_cfg), plan_memory(compiled_cfg)
    assert compiled_plan.notes == []  # planned compiled, not eagerly
    eager_saved, compiled_saved = _saved_bytes_eager_and_compiled(eager_cfg)
    assert compiled_saved < eager_saved  # Inductor keeps less: the difference the plan must show (917,504 bytes)
    planned_less = eager_plan.device["activations"] - compiled_plan.device["activations"]
    assert planned_less == eager_saved - compiled_saved
    assert eager_plan.device_peak_bytes - compiled_plan.device_peak_bytes > 0


def test_compiled_qlora_plans_what_compiled_lora_plans(tmp_path, tiny_checkpoint, tiny_data):
    # Compiled, NF4 is dequantized in a checkpointed region of its own and recomputed in backward, so a compiled
    # QLoRA block saves what a compiled LoRA block saves (tests/mtune/modules/test_nf4.py measures it with Inductor);
    # eager, the plan's peak also holds torchao's dequantization transients
    lora = plan_memory(_config(tmp_path, tiny_checkpoint, tiny_data, compile=True))
    qlora = plan_memory(_config(tmp_path, tiny_checkpoint, tiny_data, compile=True, **{"lora.quantize_base": True}))
    assert qlora.notes == [] and qlora.device["activations"] == lora.device["activations"]


def test_compile_with_checkpointing_is_planned_eagerly_and_says_so(tmp_path, tiny_checkpoint, tiny_data):
    checkpointed = {"enable_activation_checkpointing": True}
    eager = plan_memory(_config(tmp_path, tiny_checkpoint, tiny_data, compile=False, **checkpointed))
    compiled = plan_memory(_config(tmp_path, tiny_checkpoint, tiny_data, compile=True, **checkpointed))
    assert compiled.notes == ["compile=true with activation checkpointing is planned eagerly: a checkpointed block "
                              "keeps its input either way"]
    assert compiled.device == eager.device and compiled.device_peak_bytes == eager.device_peak_bytes


def test_compiled_plans_past_dynamos_recompile_limit_stay_compiled(tmp_path, tiny_checkpoint, tiny_data,
                                                                    monkeypatch):
    # --fit plans dozens of shapes in one process, each a new cache entry of the one compiled code: past dynamo's
    # limit (8 by default, 1 here) its blocks would run eagerly, unsaid (fake_mode.PLANNED_RECOMPILE_LIMIT)
    import torch._dynamo

    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    for batch in (3, 5):  # shapes no other test plans: new entries, the second past the limit
        eager = plan_memory(_config(tmp_path, tiny_checkpoint, tiny_data, compile=False, batch_size=batch))
        compiled = plan_memory(_config(tmp_path, tiny_checkpoint, tiny_data, compile=True, batch_size=batch))
        assert compiled.device["activations"] < eager.device["activations"], batch

"""A technique is one package and one registry line: a dummy technique, added to the registry, is seen by the
schema, `MemoryConfig`, the rules, the application order, resume, the ``--fit`` search, the cost model and the
out-of-memory advice, with no other file touched. Copy this test for a new technique (docs/architecture.md)."""

from dataclasses import dataclass

import pytest
import torch
from omegaconf import OmegaConf

from mtune.config import RecipeSchema
from mtune.config.keys import MODEL_NODES, RUN_KEYS, TRAINING_NODES
from mtune.config.rules import RUN_RULES
from mtune.models import build_model_from_args, model_args
from mtune.training.checkpointing.recipe_state import ResumeError, check_resume_compatible
from mtune.training.memory import registry
from tests._helpers.training import apply_memory_techniques
from mtune.training.memory.oom import memory_advice
from mtune.training.memory.technique import FitChoice, FitKnob, Footprint, MemoryTechnique, Settings, advice, setting
from mtune.training.planning import cost, fit
from mtune.training.planning.candidates import registry_knobs

BYTES_PER_TOKEN = 1e6


@dataclass(frozen=True)
class DummySettings(Settings):
    dummy_marking: bool = setting(False, "mark every block (a test technique)", must_match_on_resume=True)
    dummy_strength: int = setting(1, "how strongly", at_least=1)


class Dummy(MemoryTechnique):
    """Marks every block; moves a fixed number of bytes per token; must match on resume; refused with compile."""

    name = "dummy_marking"
    Settings = DummySettings
    fit_knob = FitKnob("dummy")

    def enabled(self, s, memory):
        return s.dummy_marking

    def on_model(self, model, s, memory, placement):
        for block in model.layers:
            block.dummy_mark = s.dummy_strength

    def fit_choices(self, s, memory, facts):
        return [FitChoice(0, {"dummy_marking": False}),
                FitChoice(1, {"dummy_marking": True}, lossy="marks", quality="low_bit_states")]

    def rules(self, s, memory):
        if s.dummy_marking and memory.compile:
            return ["dummy_marking=true cannot be combined with compile=true: set one of them false"]
        return []

    def footprint(self, s, memory, facts):
        if not s.dummy_marking:
            return Footprint()
        return Footprint(transfer_bytes_per_token=BYTES_PER_TOKEN, lossy="marks")

    def oom_advice(self, s, memory):
        return [] if s.dummy_marking else [advice("mlp_tiles", "dummy_marking=true")]


DUMMY = Dummy()
_AFTER_CHECKPOINTING = registry.TECHNIQUES.index(registry.ACTIVATION_CHECKPOINTING) + 1
TECHNIQUES = registry.TECHNIQUES[:_AFTER_CHECKPOINTING] + (DUMMY,) + registry.TECHNIQUES[_AFTER_CHECKPOINTING:]


@pytest.fixture
def registered(monkeypatch):
    """The registry with the dummy's one line added, and what the registry derives from it."""
    monkeypatch.setattr(registry, "TECHNIQUES", TECHNIQUES)
    keys = registry.memory_keys(TECHNIQUES)
    schema = RecipeSchema([RUN_KEYS, keys, MODEL_NODES, TRAINING_NODES], rules=RUN_RULES + registry.MEMORY_RULES)
    return schema, registry.MemoryConfig


def _cfg(schema, **changes):
    cfg = OmegaConf.create({"output_dir": "/nowhere", "model": {"family": "tiny", "size": "tiny"},
                            "tokenizer": {"path": None, "max_seq_len": 32}, "optimizer": {
                                "_component_": "torch.optim.AdamW", "lr": 1e-4},
                            "dataset": {"_component_": "mtune.data.instruct_dataset"}, **changes})
    return schema.fill_defaults(cfg)


def test_schema_and_memory_config_read_the_declaration(registered):
    schema, memory_config = registered
    cfg = _cfg(schema, dummy_marking=True)
    assert cfg.dummy_strength == 1  # the declared default, filled in
    memory = memory_config.from_config(cfg)
    assert memory.dummy_marking is True and memory.dummy_strength == 1
    assert any("dummy_strength" in p for p in schema.check(_cfg(schema, dummy_strength=0)))  # the declared bound
    assert any("did you mean 'dummy_marking'" in p for p in schema.check(_cfg(schema, dummy_markng=True)))


def test_rules_resume_oom_advice_and_cost_see_it(registered):
    schema, _ = registered
    assert any("dummy_marking=true cannot be combined with compile=true" in p
               for p in schema.check(_cfg(schema, dummy_marking=True, compile=True)))
    saved = OmegaConf.to_container(_cfg(schema), resolve=True)
    with pytest.raises(ResumeError, match="dummy_marking"):
        check_resume_compatible(saved, dict(saved, dummy_marking=True))
    check_resume_compatible(saved, dict(saved, dummy_strength=3))  # not must_match_on_resume: may change
    advice_lines = memory_advice(_cfg(schema))
    # in its tier: after checkpointing, before activation offloading
    assert advice_lines.index("dummy_marking=true") == advice_lines.index("enable_activation_checkpointing=true") + 1
    assert "dummy_marking=true" not in memory_advice(_cfg(schema, dummy_marking=True))
    on, off = _cfg(schema, dummy_marking=True), _cfg(schema)
    assert cost.transfer_bytes_per_token(on) - cost.transfer_bytes_per_token(off) == pytest.approx(BYTES_PER_TOKEN)
    assert cost.step_cost(on) > cost.step_cost(off)


def test_it_is_applied_in_its_place_and_searched(registered):
    schema, memory_config = registered
    model = build_model_from_args(model_args("tiny", "tiny"), dtype=torch.float32)  # meta
    memory = memory_config.from_config(_cfg(schema, dummy_marking=True, dummy_strength=3,
                                            enable_activation_checkpointing=True))
    apply_memory_techniques(model, memory)
    assert [block.dummy_mark for block in model.layers] == [3] * len(model.layers)
    names = [knob.name for knob in registry_knobs()]
    assert names.index("dummy") == names.index("activation_checkpointing") + 1  # searched in registry order
    knobs = {knob.name: knob for knob in registry_knobs()}
    assert [c.lossy for c in knobs["dummy"].choices(_cfg(schema))] == [None, "marks"]
    searched = [knobs["dummy"], knobs["micro_batch"]]
    candidates = fit.search(_cfg(schema), schema, device_memory=1 << 40, knobs=searched, max_fits=0, max_plans=0)
    assert {c.cfg.dummy_marking for c in candidates} == {True, False}
    # its rule refuses it with compile: the search never proposes the pair
    candidates = fit.search(_cfg(schema, compile=True), schema, device_memory=1 << 40, knobs=searched, max_fits=0,
                            max_plans=0)
    assert candidates and {c.cfg.dummy_marking for c in candidates} == {False}

"""The planner's cost and budget terms checked as amounts (bytes, seconds), each against a figure computed here
from the term's definition, not by calling the code under test. Each test names the mutation it was checked
against (docs/development.md): the code was broken that way once and the test failed.

The amounts that depend on a planner constant read the constant (``cost.HOST_ADAMW_SECONDS_PER_PARAM``,
``cost.MICRO_BATCH_OVERHEAD_S``) rather than repeat its value; the margin's rule, max(1 GiB, 5%), is stated where
it is what a test checks (the margin itself, and the margin ``--fit`` hands its search)."""

from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from mtune.config import RecipeSchema
from mtune.config.keys import MODEL_NODES, RUN_KEYS, TRAINING_NODES
from mtune.config.rules import RUN_RULES
from mtune.models import build_model_from_args, model_args
from mtune.training.memory import registry
from mtune.training.memory.footprint import ModelFacts
from mtune.training.memory.techniques.fsdp_cpu_offload import FsdpCpuOffload, FsdpCpuOffloadSettings
from mtune.training.planning import cost, fit
from mtune.training.planning.memory_plan import MemoryPlan

GIB = 1 << 30


def _cfg(**changes):
    schema = RecipeSchema([RUN_KEYS, registry.memory_keys(registry.TECHNIQUES), MODEL_NODES, TRAINING_NODES],
                          rules=RUN_RULES + registry.MEMORY_RULES)
    cfg = OmegaConf.create({"output_dir": "/nowhere", "device": "cpu", "dtype": "fp32",
                            "model": {"family": "tiny", "size": "tiny"},
                            "tokenizer": {"path": None, "max_seq_len": 32}, "batch_size": 2,
                            "gradient_accumulation_steps": 3,
                            "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-4},
                            "dataset": {"_component_": "mtune.data.instruct_dataset"}, **changes})
    return schema.fill_defaults(cfg)


def test_the_host_adamw_step_costs_its_seconds_per_parameter_over_the_step_tokens():
    """optimizer_offload=cpu adds, beyond its transfers, one host AdamW step per optimizer step: every trainable
    element times HOST_ADAMW_SECONDS_PER_PARAM, spread over the step's tokens.

    Mutation checked: ``host_step = 0`` in ``cost.step_cost`` (the term dropped) fails the approx assertion."""
    off, on = _cfg(), _cfg(optimizer_offload="cpu")
    model = build_model_from_args(model_args("tiny", "tiny"))  # meta: a full fine-tune trains every element
    elements = sum(p.numel() for p in model.parameters())
    step_tokens = 2 * 32 * 3  # batch_size * max_seq_len * gradient_accumulation_steps
    transfers = (cost.transfer_bytes_per_token(on) - cost.transfer_bytes_per_token(off)) / cost.REFERENCE_HOST_BANDWIDTH
    added = cost.step_cost(on) - cost.step_cost(off) - transfers  # CPU target: compute + transfers, not the max
    assert added == pytest.approx(elements * cost.HOST_ADAMW_SECONDS_PER_PARAM / step_tokens, rel=1e-9)


def test_the_micro_batch_overhead_is_paid_once_per_micro_batch():
    """Halving the micro-batch (same step tokens) adds MICRO_BATCH_OVERHEAD_S per extra micro-batch, nothing else.

    Mutation checked: the overhead divided by the step's tokens instead of the micro-batch's fails."""
    big, small = _cfg(batch_size=2, gradient_accumulation_steps=3), _cfg(batch_size=1, gradient_accumulation_steps=6)
    expected = cost.MICRO_BATCH_OVERHEAD_S * (1 / 32 - 1 / 64)  # per token: 1/(1*32) vs 1/(2*32)
    assert cost.step_cost(small) - cost.step_cost(big) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("reshard, visits", [(True, 2), (False, 1)])
def test_fsdp_cpu_offload_moves_each_shard_in_per_visit_and_each_gradient_out(reshard, visits):
    """Per rank and micro-batch token: every parameter shard comes in for forward and, when resharded after
    forward, again for backward (the re-fetch); each trainable gradient shard goes out. Amounts in bytes.

    Mutation checked: ``visits = 1`` (the backward re-fetch dropped) fails the reshard=True case."""
    facts = ModelFacts(n_layers=4, dim=64, trainable_bytes=8e6, frozen_bytes=24e6, residual_bytes=2,
                       micro_batch_tokens=1000, step_tokens=4000, trainable_numel=4_000_000, world_size=4)
    memory = SimpleNamespace(distributed=True, run=SimpleNamespace(fsdp_reshard_after_forward=reshard))
    footprint = FsdpCpuOffload().footprint(FsdpCpuOffloadSettings(fsdp_cpu_offload=True), memory, facts)
    shard_in = (8e6 + 24e6) / 4  # every parameter's shard, bytes per rank
    gradient_out = 8e6 / 4
    assert footprint.transfer_bytes_per_token == pytest.approx((visits * shard_in + gradient_out) / 1000)
    assert footprint.host_step_elements == 1_000_000  # each rank steps its quarter on its CPU


def test_allocator_margin_is_1_gib_or_5_percent():
    """Mutation checked: ``return 0`` (or the 5% dropped) in ``fit.allocator_margin`` fails."""
    assert fit.allocator_margin(8 * GIB) == GIB  # 5% = 0.4 GiB < 1 GiB
    assert fit.allocator_margin(20 * GIB) == GIB  # 5% = exactly 1 GiB
    assert fit.allocator_margin(80 * GIB) == 4 * GIB  # 5% = 4 GiB


def _plan(device_peak, host_peak, context=0):
    return MemoryPlan(target="cuda", world_size=1, device_peak_bytes=device_peak, host_peak_bytes=host_peak,
                      device={}, host={}, at_peak={}, batch={}, parameters={}, predicts="", cuda_context_bytes=context)


def test_a_fit_keeps_the_margin_and_the_context_within_the_device_and_the_host_peak_within_the_host():
    """Byte-exact edges of ``fits_budgets``: device peak + context + margin <= device memory; host peak <= host.

    Mutations checked: the margin not subtracted fails the first ``not``; the host budget ignored
    (``spare["host"] is None or True``) fails the last ``not``."""
    budget, margin, context = 24 * GIB, GIB, 512 << 20
    peak = budget - margin - context
    assert fit.fits_budgets(_plan(peak, 10, context), budget, None, margin)
    assert not fit.fits_budgets(_plan(peak + 1, 10, context), budget, None, margin)
    assert fit.fits_budgets(_plan(peak, 10 * GIB, context), budget, 10 * GIB, margin)
    assert not fit.fits_budgets(_plan(peak, 10 * GIB + 1, context), budget, 10 * GIB, margin)


def test_fit_searches_with_each_ranks_host_share_and_the_margin(monkeypatch, capsys):
    """``mtune plan --fit`` over 8 ranks with 64 GiB of host memory plans each rank against 8 GiB and keeps the
    24 GiB device's 1.2 GiB margin: the search receives those amounts.

    Mutation checked: ``fit_command`` passing the machine's host memory (or None) to ``search`` instead of the
    per-rank share fails here, while every fit/plan/CLI test passed under it (issue 38)."""
    seen = {}

    def fake_search(cfg, schema, **kwargs):
        seen.update(kwargs)
        return []

    monkeypatch.setattr(fit, "search", fake_search)
    code = fit.fit_command(None, recipe="lora_distributed", config_path=Path("x.yaml"), overrides=[], schema=None,
                           device_memory=24 * GIB, host_memory=64 * GIB, world_size=8, output=Path("unused.yaml"))
    assert code == 1  # nothing fits: the fake search found nothing
    assert seen["host_memory"] == 8 * GIB and seen["world_size"] == 8
    assert seen["margin"] == int(0.05 * 24 * GIB)
    assert seen["estimator"].host_memory == 8 * GIB
    assert "(host 8.00 GiB)" in capsys.readouterr().out


def test_every_planner_constant_names_its_measurement_or_citation():
    """Each constant's docstring points at benchmarks/results/README.md (or its measurement file), and that README's
    table has a row for it. Mutation checked: deleting a row from the README fails."""
    import ast

    repo = Path(__file__).resolve().parents[4]
    table = (repo / "benchmarks" / "results" / "README.md").read_text()
    where = {"cost.py": ["REFERENCE_FLOPS", "REFERENCE_HOST_BANDWIDTH", "MICRO_BATCH_OVERHEAD_S",
                         "HOST_ADAMW_SECONDS_PER_PARAM"],
             "memory_plan.py": ["CUDA_CONTEXT_BYTES", "CUDA_BLOCK_BYTES"], "fit.py": ["allocator_margin"],
             "candidates.py": ["NEGLIGIBLE_SAVING"]}
    for file, names in where.items():
        body = ast.parse((repo / "mtune" / "training" / "planning" / file).read_text()).body
        for name in names:
            i = next(i for i, node in enumerate(body) if name in {getattr(t, "id", None) for t in
                                                                  getattr(node, "targets", [])}
                     or getattr(node, "name", None) == name)
            node = body[i]
            doc = (ast.get_docstring(node) if isinstance(node, ast.FunctionDef)
                   else body[i + 1].value.value)  # the string after the assignment
            assert "benchmarks/" in doc, (file, name)
            assert f"`{file.removesuffix('.py')}.{name}`" in table, name


def test_fit_maximize_seq_len_searches_with_each_ranks_host_share_and_the_margin(monkeypatch, capsys):
    """The same amounts for ``mtune plan --fit --maximize seq_len`` (`longest_command`).

    Mutation checked: ``longest_command`` passing ``host_memory=None`` to ``longest_context`` fails."""
    from mtune.training.planning import longest

    seen = {}

    def fake_longest(cfg, schema, **kwargs):
        seen.update(kwargs)
        return SimpleNamespace(candidate=None)

    monkeypatch.setattr(longest, "longest_context", fake_longest)
    code = longest.longest_command(None, recipe="lora_distributed", config_path=Path("x.yaml"), overrides=[],
                                   schema=None, maximize="seq_len", device_memory=24 * GIB, host_memory=64 * GIB,
                                   world_size=8, output=Path("unused.yaml"))
    assert code == 1
    assert seen["host_memory"] == 8 * GIB and seen["margin"] == int(0.05 * 24 * GIB)
    assert seen["estimator"].host_memory == 8 * GIB


@pytest.mark.parametrize("config", ["llama3_2/1B_qlora_single_device",   # the head tied to the embedding
                                    "llama3_1/8B_qlora_single_device"])  # a head of its own
def test_qloras_frozen_bytes_keep_the_embedding_and_the_head_in_their_dtype(config):
    # Oracle: the parameter bytes the planner tracked for the tiny config (the golden plan), which holds real NF4
    # tensors for the blocks' projections and the embedding and head in bf16: the cost model's weights are those,
    # less each small tensor's rounding to a 512-byte allocation (an NF4 weight is several tensors: 2-3% on these
    # tiny shapes). Mutation seen failing: NF4 bytes for every frozen 2-D weight (the embedding and head too): 0.81
    # and 0.70 of the plan's.
    import json

    from tests._helpers.paths import REPO
    from tests._helpers.shipped import shipped_on_tiny

    facts = cost.model_facts(shipped_on_tiny(config)[2])
    golden = json.loads((REPO / "tests" / "assets" / "plans" / "shipped_flag_sets.json").read_text())[config]
    assert 0.97 * golden["device"]["parameters"] <= facts.frozen_bytes + facts.trainable_bytes \
        <= golden["device"]["parameters"]


@pytest.mark.parametrize("kind, checkpointing, moved", [
    ("block_level", True, 2 * 20e6),        # the blocks' weights in forward and again in backward, nothing else
    ("leaf_level", False, 2 * 20e6 + 4e6),  # and the embedding and the head, once each, in forward
    ("leaf_level", True, 3 * 20e6 + 4e6),   # the blocks' a third time for their recomputation
])
def test_weight_offloading_moves_the_blocks_weights_per_visit_and_the_rest_once(kind, checkpointing, moved):
    """Bytes per micro-batch token. Mutation checked: every frozen byte per visit (the embedding and head with the
    blocks', as before 2026-11-27) fails all three."""
    from mtune.training.memory.techniques.activation_checkpointing import ACTIVATION_CHECKPOINTING
    from mtune.training.memory.techniques.weight_offloading import (WEIGHT_OFFLOADING, WeightOffloading,
                                                                    WeightOffloadingSettings)

    facts = ModelFacts(n_layers=4, dim=64, trainable_bytes=1e6, frozen_bytes=24e6, frozen_block_bytes=20e6,
                       residual_bytes=2, micro_batch_tokens=1000, step_tokens=4000)
    memory = {ACTIVATION_CHECKPOINTING: SimpleNamespace(enable_activation_checkpointing=checkpointing)}
    settings = WeightOffloadingSettings(weight_offloading=WeightOffloading(kind, 1, True))
    footprint = WEIGHT_OFFLOADING.footprint(settings, memory, facts)
    assert footprint.transfer_bytes_per_token == pytest.approx(moved / 1000)


def test_the_frozen_bytes_inside_the_blocks_are_the_blocks_weights():
    # Llama 3.2's tiny QLoRA: the embedding (tied to the head) and the final norm stay outside, in bf16.
    from tests._helpers.shipped import shipped_on_tiny

    cfg = shipped_on_tiny("llama3_2/1B_qlora_single_device")[2]
    facts = cost.model_facts(cfg)
    args = model_args("llama3_2", "tiny")
    assert facts.frozen_bytes - facts.frozen_in_blocks == (args.vocab_size * args.dim + args.dim) * 2


def _candidate(name, cost, *, lossy=(), quality_cost=0, fits=None):
    from mtune.training.planning.candidates import Candidate

    return Candidate({"name": name}, (0, 1), cost, lossy=lossy, quality_cost=quality_cost, fits=fits, micro_batch=1)


def test_search_phases_put_lossless_first_and_order_lossy_by_what_they_give_up():
    """fallback: lossless by cost, then lossy by quality given up (not cost); never: lossless only; compete: all by
    cost. Mutations checked: the lossy phase sorted by speed alone; ``never`` keeping the lossy candidates."""
    slow, fast = _candidate("slow", 2.0), _candidate("fast", 1.0)
    mild = _candidate("mild", 0.5, lossy=("fp8",), quality_cost=1)
    harsh = _candidate("harsh", 0.1, lossy=("nf4",), quality_cost=2)  # fastest of all, but gives up the most
    names = lambda phases: [[c.overrides["name"] for c in phase] for phase in phases]  # noqa: E731
    everything = [slow, harsh, fast, mild]
    assert names(fit.search_phases(everything, "fallback")) == [["fast", "slow"], ["mild", "harsh"]]
    assert names(fit.search_phases(everything, "never")) == [["fast", "slow"]]
    assert names(fit.search_phases(everything, "compete")) == [["harsh", "mild", "fast", "slow"]]


def test_best_of_is_the_cheapest_fitting_candidate_wherever_it_stands():
    """Of the fitting candidates the cheapest, not the first found; unfitting and unplanned ones are never it.
    Mutation checked: ``best_of`` returning the first fitting candidate."""
    first = _candidate("first", 3.0, fits=True)
    found = [first, _candidate("over", 1.0, fits=False), _candidate("best", 2.0, fits=True),
             _candidate("unplanned", 0.5)]
    assert fit.best_of(found).overrides == {"name": "best"}
    assert fit.best_of([_candidate("over", 1.0, fits=False)]) is None


@pytest.mark.parametrize("batch_size, accumulation, splits", [
    (2, 4, [(8, 1), (4, 2), (2, 4), (1, 8)]), (4, 3, [(12, 1), (6, 2), (3, 4)]), (1, 1, [(1, 1)])])
def test_micro_batch_choices_halve_the_samples_per_step_down_to_one_or_odd(batch_size, accumulation, splits):
    """Every power-of-two split of the config's samples per step, at levels 0, 1, 2, ...: by hand, 8 -> 8, 4, 2, 1
    and 12 -> 12, 6, 3. Mutation checked: the halving stopped one step early."""
    from mtune.training.planning.candidates import _micro_batch

    choices = _micro_batch(_cfg(batch_size=batch_size, gradient_accumulation_steps=accumulation))
    assert [(c.level, c.overrides) for c in choices] == [
        (level, {"batch_size": b, "gradient_accumulation_steps": a}) for level, (b, a) in enumerate(splits)]


def test_dominates_counts_equal_levels_as_saving_as_much():
    """Levels equal on every knob save as much (so a candidate equal to one over the device is pruned); one knob lower
    is not dominated. Mutation checked: ``<`` for ``<=`` in ``dominates``."""
    from mtune.training.planning.judge import dominates

    assert dominates((1, 2, 0), (1, 2, 0)) and dominates((2, 2, 1), (1, 2, 0))
    assert not dominates((1, 2, 0), (2, 1, 0)) and not dominates((1, 2, 0), (1, 2, 1))


def test_a_floor_exactly_at_the_budget_fits_and_a_byte_over_does_not():
    """``floor_reason``: floor + context <= device budget passes; host floor <= host budget passes. The tiny model's
    fp32 floor is weights + AdamW's two states + gradients = 4 x its 5,772,288 weight bytes.
    Mutation checked: ``need >= device_budget``."""
    from mtune.training.planning.candidates import floor_reason
    from mtune.units import format_bytes

    weights, context = 5_772_288, 1000
    need = 4 * weights + context
    cfg = _cfg()
    assert floor_reason(cfg, need, None, context, 1) is None
    assert floor_reason(cfg, need - 1, None, context, 1).endswith(f" > {format_bytes(need - 1)}")
    offloaded = _cfg(optimizer_offload="cpu")  # states (2 x) and host copies with gradients (2 x) on the host
    assert floor_reason(offloaded, weights, 4 * weights, 0, 1) is None
    assert floor_reason(offloaded, weights, 4 * weights - 1, 0, 1).startswith("host: ")


class _NoPlans:
    """An estimator that must not be asked: the candidates here are decided by their floors."""

    planned = derived = 0

    def estimate(self, *args, **kwargs):
        raise AssertionError("planned a candidate its floor rejects")


def test_the_judge_holds_the_floor_to_the_budget_less_the_margin_and_prunes_only_for_the_device():
    """A floor within the device but not within device - margin is rejected unplanned; a rejection by the host floor
    prunes nothing (a candidate saving less on the device puts less on the host). Mutations checked: the margin not
    subtracted from the floor's budget; host rejections recorded as failed levels."""
    from mtune.training.planning.candidates import Candidate
    from mtune.training.planning.judge import Judge

    weights, margin = 5_772_288, 1 << 20
    cfg = _cfg()
    device_only = Candidate({}, (0, 0), 1.0, base=cfg)
    judge = Judge(cfg, _NoPlans(), knobs=[], device_memory=4 * weights + margin - 1, host_memory=None, margin=margin,
                  world_size=1)
    judge.consider(device_only)
    assert device_only.fits is False and device_only.reason is not None and judge.failed == [(0, 0)]
    offloaded = Candidate({"optimizer_offload": "cpu"}, (1, 0), 1.0, base=cfg)
    judge = Judge(cfg, _NoPlans(), knobs=[], device_memory=64 * GIB, host_memory=4 * weights - 1, margin=margin,
                  world_size=1)
    judge.consider(offloaded)
    assert offloaded.fits is False and offloaded.reason.startswith("host: ") and judge.failed == []


@pytest.mark.parametrize("cuda", [False, True])
def test_a_floor_only_choice_is_searched_from_2_percent_of_the_budget_less_the_cuda_context(monkeypatch, cuda):
    """NEGLIGIBLE_SAVING's edge, with the floors stubbed: the budget less the CUDA context (on CUDA) holds 5000 bytes
    for tensors, so a choice saving 100 bytes (exactly 2%) is searched and one saving 99 is not; without the context
    subtracted, 100 would fall under 2% of the whole budget on CUDA."""
    from mtune.training.memory.technique import FitChoice
    from mtune.training.planning import candidates
    from mtune.training.planning.memory_plan import CUDA_CONTEXT_BYTES

    floors = {"off": 10_000, "saves_100": 9_900, "saves_99": 9_901}
    monkeypatch.setattr(candidates, "device_floor", lambda cfg, world_size: ({"parameters": floors[cfg.choice]}, {}))
    monkeypatch.setattr(candidates, "model_facts", lambda cfg: SimpleNamespace(cuda=cuda))
    options = [FitChoice(level, {"choice": name}) for level, name in enumerate(floors)]
    knob = candidates.Knob("stub", lambda cfg: options, floor_only=True)
    budget = 5000 + (CUDA_CONTEXT_BYTES if cuda else 0)
    assert candidates.NEGLIGIBLE_SAVING * 5000 == 100  # the edge is exact in floating point
    kept = candidates._worth_searching(OmegaConf.create({"choice": "off"}), knob, options, budget, 1)
    assert [c.overrides["choice"] for c in kept] == ["off", "saves_100"]


def test_on_cuda_transfers_overlap_compute_so_only_the_larger_is_paid():
    """On a CUDA target the copies run on side streams: max(compute, transfers), not their sum as on the CPU.

    Mutation checked: ``compute + transfers`` on every target (the overlap dropped) fails."""
    cpu, cuda = _cfg(device="cpu", optimizer_offload="cpu"), _cfg(device="cuda", optimizer_offload="cpu")
    compute = cost.model_flops_per_token(cpu) / cost.REFERENCE_FLOPS
    transfers = cost.transfer_bytes_per_token(cpu) / cost.REFERENCE_HOST_BANDWIDTH
    assert transfers > compute  # optimizer offload's copies dominate the tiny model's FLOPs
    # the same candidate on either target differs only by the smaller term, which CUDA hides
    assert cost.step_cost(cpu) - cost.step_cost(cuda) == pytest.approx(compute, rel=1e-6)


def test_paged_state_costs_two_transfers_of_its_bytes_per_step():
    """``paged_bytes`` of managed state cross the host link about twice a step, spread over the step's tokens.

    Mutation checked: ``paging = paged_bytes`` (one crossing) fails."""
    cfg, paged = _cfg(), 1e9
    step_tokens = 2 * 32 * 3  # batch_size * max_seq_len * gradient_accumulation_steps
    expected = 2 * paged / cost.REFERENCE_HOST_BANDWIDTH / step_tokens
    assert cost.step_cost(cfg, paged_bytes=paged) - cost.step_cost(cfg) == pytest.approx(expected, rel=1e-9)


def test_the_host_floor_is_each_ranks_share():
    """Over 4 ranks optimizer offload's host floor is a quarter of the model's: AdamW's two fp32 states and the
    host copies with gradients, each 2 x the 5,772,288 fp32 weight bytes. Mutation checked: the host floor not
    divided by ``world_size`` (the device one was)."""
    weights = 5_772_288
    device, host = cost.device_floor(_cfg(optimizer_offload="cpu"), 4)
    assert device == {"fp32 trainable weights": weights / 4}
    assert host == {"optimizer states (AdamW)": 2 * weights / 4, "host copies and gradients": 2 * weights / 4}


def test_a_search_counts_each_sequence_lengths_flops_apart():
    """Inside one search (`cost.one_search`, shared caches) a longer max_seq_len still costs its longer attention:
    the tiny model's QK^T and PV, forward and backward, add 12 * 32 more positions * 4 heads * 64 * 2 layers FLOPs
    per token at 64 than at 32. Mutation checked: ``seq_len`` left out of the FLOPs cache key."""
    short, long = _cfg(), _cfg(tokenizer={"path": None, "max_seq_len": 64})
    with cost.one_search():
        difference = cost.model_flops_per_token(long) - cost.model_flops_per_token(short)
    assert difference == 12 * 32 * 4 * 64 * 2

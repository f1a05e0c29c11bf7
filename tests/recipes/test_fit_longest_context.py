"""``mtune plan --fit --maximize seq_len`` on the tiny LoRA config: the length it answers fits and one step more
does not (both checked with whole plans, not the search's line), the written YAML validates and asks for what was
planned, the model's trained context stops the search, and the CLI refuses what it cannot answer."""

import pytest

from mtune._cli.catalog import find_recipe, load_recipe_module
from mtune._cli.errors import UsageError
from mtune._cli.plan import plan_command
from mtune._cli.run import load_and_check
from mtune.training.planning.candidates import with_overrides
from mtune.training.planning.estimate import Estimator
from mtune.training.planning.fit import FitError
from mtune.training.planning.longest import STEP, longest_command, longest_context
from mtune.training.planning.plan import plan_memory
from tests._helpers.recipes import TRAIN_CONFIG, train_overrides, write_tiny_checkpoint

BUDGET = 160 * 1024**2
"""Device bytes of the question (no margin: the tests ask with margin 0): the tiny LoRA config reaches ~8K tokens."""


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory):
    """The tiny Llama 3.1-shaped model, trained (by its config) to 16K tokens."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("long"), max_position_embeddings=16384)


def _config(tmp_path, checkpoint, data, **changes):
    module = load_recipe_module(find_recipe("lora_single_device"))
    overrides = train_overrides(tmp_path, checkpoint, data, **changes)
    return module, overrides, load_and_check(module, TRAIN_CONFIG, overrides)


def _fits(cfg, budget) -> bool:
    return plan_memory(cfg).device_total_bytes <= budget


def test_the_answer_fits_and_one_step_longer_does_not(tmp_path, long_checkpoint, tiny_data):
    module, _, cfg = _config(tmp_path, long_checkpoint, tiny_data)
    result = longest_context(cfg, module.SCHEMA, device_memory=BUDGET, host_memory=None, margin=0,
                             estimator=Estimator(device_memory=BUDGET, host_memory=None))
    answer = result.candidate.cfg
    assert 4096 <= result.seq_len < 16384 and not result.capped, result.reach
    assert answer.tokenizer.max_seq_len == result.seq_len and answer.dataset.packed and answer.batch_size == 1
    assert answer.gradient_accumulation_steps == cfg.batch_size * cfg.gradient_accumulation_steps  # samples kept
    assert _fits(answer, BUDGET)
    # no maximal candidate (every saving the rules allow together) fits one step more than it reached
    assert max(length for _, length in result.reach) == result.seq_len
    for candidate, length in result.reach:
        assert not _fits(with_overrides(candidate.cfg, {"tokenizer.max_seq_len": length + STEP,
                                                        "mlp_tiles": "auto"}), BUDGET)
    assert result.limiting.split()[0] in ("activations", "temporaries")  # what grows with the row, not weights
    peaks = [plan.device_total_bytes for _, plan in result.curve]
    assert peaks == sorted(peaks) and [s for s, _ in result.curve][-1] == result.seq_len


def test_the_trained_context_stops_it_and_the_yaml_asks_for_it(tmp_path, long_checkpoint, tiny_data, capsys):
    module, overrides, cfg = _config(tmp_path, long_checkpoint, tiny_data, **{"tokenizer.max_seq_len": 64})
    output = tmp_path / "longest.yaml"
    # a budget a 16K row fits easily: the answer is the model's trained context, said so
    assert longest_command(cfg, recipe="lora_single_device", config_path=TRAIN_CONFIG, overrides=overrides,
                           schema=module.SCHEMA, maximize="seq_len", device_memory=8 * 1024**3,
                           host_memory=8 * 1024**3, world_size=1, output=output) == 0
    out = capsys.readouterr().out
    assert "answer: 16,384 tokens per row" in out and "trained context, 16,384 tokens" in out
    # the curve: 8,192 (the first probe) and the answer's 16,384, once each (a power of two is not listed twice)
    assert [line.split()[0] for line in out.splitlines() if line.endswith(("GiB", "MiB", "KiB", "(on the line)"))
            and " tokens  " in line] == ["8,192", "16,384"]
    written = load_and_check(module, output, [])  # validates
    assert written.tokenizer.max_seq_len == 16384 and written.dataset.packed and written.batch_size == 1


def test_what_it_cannot_answer_is_refused(tmp_path, tiny_checkpoint, tiny_data):
    module, overrides, cfg = _config(tmp_path, tiny_checkpoint, tiny_data)
    with pytest.raises(FitError, match="--maximize throughput: one of seq_len"):
        longest_command(cfg, recipe="lora_single_device", config_path=TRAIN_CONFIG, overrides=overrides,
                        schema=module.SCHEMA, maximize="throughput", device_memory=BUDGET, host_memory=None,
                        world_size=1, output=tmp_path / "x.yaml")
    with pytest.raises(UsageError, match="add --fit"):
        plan_command(["--maximize", "seq_len", "lora_single_device", "--config", str(TRAIN_CONFIG), *overrides])
    # the tiny model's trained context (512 tokens) is shorter than any long-context answer
    with pytest.raises(FitError, match="trained context is 512 tokens"):
        longest_command(cfg, recipe="lora_single_device", config_path=TRAIN_CONFIG, overrides=overrides,
                        schema=module.SCHEMA, maximize="seq_len", device_memory=BUDGET, host_memory=None,
                        world_size=1, output=tmp_path / "y.yaml")


def test_a_larger_host_never_gives_a_shorter_answer(tmp_path, long_checkpoint, tiny_data):
    """A CUDA target (offloaded block inputs take host memory) asked on hosts of 2 and 64 MiB: the longest row does
    not shrink as the host grows, each answer's host share is within its host (2 MiB holds less than the tiny
    model's frozen weights: the answer keeps them on the device). Before the candidates that hold nothing on the
    host were searched beside the maxima (`longest._reaching`), the 2 MiB host answered nothing at all."""
    from mtune.training.planning.memory_plan import CUDA_CONTEXT_BYTES

    module, _, cfg = _config(tmp_path, long_checkpoint, tiny_data, device="cuda",
                             activation_offloading_use_streams=False)
    budget = CUDA_CONTEXT_BYTES + BUDGET
    estimator = Estimator(device_memory=budget, host_memory=None)  # plans do not depend on the host: shared
    answers = []
    for host in (2, 64):
        result = longest_context(cfg, module.SCHEMA, device_memory=budget, host_memory=host << 20, margin=0,
                                 estimator=estimator)
        plan = result.curve[-1][1]
        assert plan.host_need_bytes <= host << 20 and plan.device_total_bytes <= budget
        answers.append((result.seq_len, result.candidate.changes.get("activation_offloading_blocks")))
    lengths = [length for length, _ in answers]
    assert lengths == sorted(lengths) and lengths[0] > 0, answers


def test_the_search_at_the_reached_length_answers_as_the_cheapest_first_search(tmp_path, long_checkpoint, tiny_data):
    """At the reached length ``--maximize`` searches from the most saving candidates down
    (`longest._search_maxima_first`), first judging the candidate whose reach found the length; its answer must be
    the cheapest-first ``--fit`` search's, left to plan every candidate it reaches (no cap), whichever candidate is
    judged first (here the most saving one, which fits and is not the answer). Asked of the tiny model's 8K-token
    packed rows on a CUDA target near its edge (`test_fit_host` judges the host's rule of pruning). Mutation seen
    failing: a fit closing the candidates of its cost that rank before it (fewer techniques: the ties rule), not
    only the costlier ones."""
    from mtune.training.planning.fit import best_of, search
    from mtune.training.planning.longest import _one_row_knobs, _search_maxima_first, long_context_base
    from mtune.training.planning.memory_plan import CUDA_CONTEXT_BYTES
    from mtune.training.planning.reach import at_length

    module, _, cfg = _config(tmp_path, long_checkpoint, tiny_data, device="cuda",
                             activation_offloading_use_streams=False)
    at = at_length(long_context_base(cfg)[0], 8192)
    budget = CUDA_CONTEXT_BYTES + BUDGET
    estimator = Estimator(device_memory=budget, host_memory=None)  # the plans are the same: shared
    answers = []
    for find, extra in ((search, {"max_plans": 10**6, "max_fits": 10**6}), (_search_maxima_first, {}),
                        (_search_maxima_first, {"first": "the most saving"})):
        if extra.get("first"):
            extra = {"first": max(found, key=lambda c: sum(c.levels)).levels}
        found = find(at, module.SCHEMA, knobs=_one_row_knobs(), estimator=estimator, device_memory=budget,
                     host_memory=None, margin=0, lossy="fallback", world_size=1, **extra)
        answer = best_of(found)
        answers.append(None if answer is None else answer.changes)
    assert answers[0] is not None and answers[0] == answers[1] == answers[2], answers
    seeded = next(c for c in found if c.levels == extra["first"])
    assert seeded.fits and seeded.changes != answers[0]  # judged first: it fits, and is not the answer


def test_only_a_reach_planned_over_the_device_prunes_at_the_reached_length():
    """A maximal candidate the reach planned over a budget prunes at the reached length only where it was over the
    device (`longest._over_device`): over the host alone, a candidate that offloads less may fit; and only from a
    plan made already (no plan is run for it). Mutations seen failing: the device check dropped (the host-only
    failure counted), the planned-already check dropped."""
    from types import SimpleNamespace

    from mtune.training.planning.longest import _over_device
    from mtune.training.planning.reach import Fitter as RealFitter

    class Fitter:
        within_device = RealFitter.within_device  # the real judgement of a plan's device spare

        def __init__(self, device_spare: int, plans_run: int = 0):
            self.margin, self.estimator = 10, SimpleNamespace(planned=3)
            self.device_spare, self.plans_run = device_spare, plans_run

        def fitting_plan(self, variant, length):
            self.estimator.planned += self.plans_run
            return SimpleNamespace(fits=lambda: {"device": self.device_spare, "host": -1})

    assert _over_device(Fitter(5), None, 1024)  # 5 bytes spare, less than the margin: over the device
    assert not _over_device(Fitter(20), None, 1024)  # within the device, over the host alone
    assert not _over_device(Fitter(5, plans_run=2), None, 1024)  # not planned before


class _EdgeAt:
    """A stand-in for `reach.Fitter`'s planning: a length fits exactly when it is at most ``edge`` tokens (the peak
    grows with the length), so `Fitter._edge`'s walk is checked without a plan."""

    def __init__(self, edge: int):
        from mtune.training.planning.reach import Fitter

        self.edge, self._edge = edge, Fitter._edge.__get__(self)

    def fitting_plan(self, cfg, length):
        return length

    def fits(self, length):
        return length <= self.edge


@pytest.mark.parametrize("guess, edge, limit, expected", [
    (9000, 10_500, 16_384, 10 * 1024),         # the line short of the edge: walked up, a multiple of 1024
    (11_500, 10_500, 16_384, 10 * 1024),       # the line one step past it: the step below
    (20_000, 10_500, 65_536, 10 * 1024),       # far past it: walked down
    (100_000, 200_500, 262_144, 195 * 1024),   # far short of a long edge: walked up in 3% strides, then bisected
    (300_000, 200_500, 400_000, 195 * 1024),   # far past it: walked down in strides, then bisected
    (9000, 20_000, 16_000, 16_000),            # every length fits: the limit itself, not a multiple
    (4096, 1000, 16_384, 0),                   # not even SHORTEST (1024) fits
])
def test_the_edge_is_the_longest_fitting_multiple_of_the_step(guess, edge, limit, expected):
    """`Fitter._edge` answers the largest multiple of STEP (1024) at most the fitting edge, or the limit, whatever
    the line guessed (by hand: 10,500 // 1024 = 10 steps, 200,500 // 1024 = 195). Mutations checked: the length not
    rounded to the step; the guess returned without trying a step beyond it; the non-fitting guess returned instead
    of the step below; the bisection stopped a step short."""
    assert _EdgeAt(edge)._edge(None, guess, limit) == expected

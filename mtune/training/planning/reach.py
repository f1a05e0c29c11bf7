"""How long a candidate's rows may be (`Fitter.longest`): the candidate planned at two lengths, the line through
the two spares solved for each budget, then planned at that length and walked to the edge; a candidate that
offloads every block's input where the host cannot hold them all offloads as many as it holds at each length."""

from __future__ import annotations

from collections.abc import Callable

from mtune.training.memory import registry
from mtune.training.memory.registry import MemoryConfig
from mtune.training.planning.candidates import with_overrides
from mtune.training.planning.cost import model_facts
from mtune.training.planning.estimate import Estimator
from mtune.training.planning.fit import fits_budgets
from mtune.training.planning.host import block_offload, fewer_offloaded_blocks
from mtune.training.planning.memory_plan import MemoryPlan
from mtune.units import format_bytes

__all__ = ["Fitter", "at_length", "length_overrides", "STEP", "SHORTEST", "PROBES"]

STEP = 1024
"""The answer's length is a multiple of this many tokens."""

SHORTEST = 1024
"""A candidate that does not fit rows of this many tokens is not a long-context answer."""

PROBES = (8192, 32768)
"""The two row lengths each maximal candidate is planned at first (the line through them is solved)."""


def at_length(cfg, seq_len: int):
    """``cfg`` with rows of ``seq_len`` tokens."""
    return with_overrides(cfg, {"tokenizer.max_seq_len": int(seq_len)})


def length_overrides(cfg, any_length: bool) -> dict:
    """Every technique's `MemoryTechnique.length_overrides` for ``cfg``: made to hold at any length, or written out
    for its own rows."""
    memory, facts = MemoryConfig.from_config(cfg), model_facts(cfg)
    return {k: v for t in registry.TECHNIQUES for k, v in t.length_overrides(memory[t], memory, facts,
                                                                             any_length).items()}


def _written_out(cfg):
    """``cfg`` with its length-free settings written out for its rows: the config ``--fit``'s search plans at
    that length (one cache key for both)."""
    overrides = length_overrides(cfg, any_length=False)
    return with_overrides(cfg, overrides) if overrides else cfg


def _offloads_every_block(cfg) -> bool:
    """Whether ``cfg`` offloads every block's saved input to the host."""
    offload = block_offload(cfg)
    return offload is not None and offload.blocks == offload.n_layers


class Fitter:
    """Plans a candidate at a length and says whether it fits, as ``--fit`` judges it (device total plus the
    allocator margin within the device budget, host share within the host budget). A candidate that offloads every
    block's input where the host cannot hold them all offloads as many as it holds
    (`~mtune.training.planning.host.fewer_offloaded_blocks`), as ``--fit`` does."""

    def __init__(self, estimator: Estimator, device_memory: int, host_memory: int | None, margin: int):
        self.estimator, self.device_memory, self.host_memory, self.margin = (estimator, device_memory, host_memory,
                                                                             margin)

    def plan(self, cfg, seq_len: int) -> MemoryPlan:
        return self._plan_of(_written_out(at_length(cfg, seq_len)))

    def _plan_of(self, at) -> MemoryPlan:
        """The plan of ``at`` (a config at its length), with the budgets recorded on it."""
        plan = self.estimator.estimate(at)
        plan.device_memory, plan.host_memory = self.device_memory, self.host_memory
        return plan

    def host_spare(self, plan: MemoryPlan) -> int | None:
        plan.device_memory, plan.host_memory = self.device_memory, self.host_memory
        return plan.fits()["host"]

    def fitting_plan(self, cfg, seq_len: int) -> MemoryPlan:
        """``cfg``'s plan at ``seq_len``, with fewer blocks offloaded where the host cannot hold every block's."""
        at = _written_out(at_length(cfg, seq_len))
        plan = self._plan_of(at)
        fewer = fewer_offloaded_blocks(at, plan, self.estimator, self.host_spare)
        if fewer is not None:
            plan = fewer[1]
            plan.device_memory, plan.host_memory = self.device_memory, self.host_memory
        return plan

    def fits(self, plan: MemoryPlan) -> bool:
        return fits_budgets(plan, self.device_memory, self.host_memory, self.margin)

    def within_device(self, plan: MemoryPlan) -> bool:
        """Whether ``plan`` (one of this fitter's: its budgets recorded) fits the device less the margin, whatever
        the host."""
        return plan.fits()["device"] - self.margin >= 0

    def spare(self, plan: MemoryPlan) -> list[int]:
        """Bytes left per budget (device less the margin; host where there is one)."""
        spare = plan.fits()
        return [spare["device"] - self.margin] + ([spare["host"]] if spare["host"] is not None else [])

    def longest(self, cfg, limit: int, say: Callable[[str], None], planned: int | None = None) -> int:
        """The longest multiple of :data:`STEP` up to ``limit`` (or ``limit`` itself) at which ``cfg`` fits; 0
        when not even :data:`SHORTEST`. ``planned``: a length beyond the first probe at which ``cfg`` was planned
        already (and fits), the line's far end instead of the second probe: nearer the edge, and no plan."""
        far = planned if planned is not None and planned > PROBES[0] else PROBES[1]
        short, long_ = (min(p, limit) for p in (PROBES[0], far))
        guess = limit
        if long_ > short:
            p, q = self.plan(cfg, short), self.plan(cfg, long_)
            reach = [limit]
            for s_p, s_q in zip(self.spare(p), self.spare(q)):
                slope = (s_q - s_p) / (long_ - short)  # spare bytes per token (negative: the peak grows)
                reach.append(int(short + s_p / -slope) if slope < 0 else limit)
            guess = min(reach)
            if len(reach) == 3 and reach[2] < reach[1] and _offloads_every_block(cfg):
                # the host is what the line stops at: with fewer blocks offloaded, the device holds the rest
                guess = self._guess_with_fewer_blocks(cfg, short, long_, p, q, limit)
            say(f"  {format_bytes(p.device_total_bytes)} at {short:,}, {format_bytes(q.device_total_bytes)} at "
                f"{long_:,} tokens: the line reaches {guess:,}")
        return self._edge(cfg, max(SHORTEST, guess), limit)

    def _guess_with_fewer_blocks(self, cfg, short: int, long_: int, p: MemoryPlan, q: MemoryPlan,
                                 limit: int) -> int:
        """The longest length the lines say fits when at each length as many blocks offload as the host holds:
        each budget's spare with every block offloaded (``p``, ``q``) and with none
        (``activation_offloading_blocks: 0``) is a line in the length, and so (between them) is each N's."""
        zero = with_overrides(cfg, {block_offload(cfg).key: 0})
        zp, zq = self.plan(zero, short), self.plan(zero, long_)

        def line(a: MemoryPlan, b: MemoryPlan) -> Callable[[int], float]:
            (a_d, a_h), (b_d, b_h) = self.spare(a), self.spare(b)
            return lambda s, i: (a_d, a_h)[i] + ((b_d, b_h)[i] - (a_d, a_h)[i]) * (s - short) / (long_ - short)

        every, none = line(p, q), line(zp, zq)
        best = 0
        for length in range(SHORTEST, limit + 1, STEP):
            host_every, host_none = every(length, 1), none(length, 1)
            if host_none < 0:
                break
            t = 1.0 if host_every >= 0 else host_none / (host_none - host_every)
            if none(length, 0) + t * (every(length, 0) - none(length, 0)) < 0:
                break
            best = length
        return best

    def _edge(self, cfg, guess: int, limit: int) -> int:
        """The longest length that fits, from the line's ``guess``: planned there and one step beside it (up where
        it fits, down where not), which settles it when the line is right to a step; else walked up or down by 3%
        (or :data:`STEP`) to the first length on the other side, then bisected to :data:`STEP` tokens (what is
        not linear in the peak moves the edge a few steps at most)."""

        def at(length: int) -> int:
            return limit if length >= limit else max(SHORTEST, length // STEP * STEP)

        def fits(length: int) -> bool:
            return self.fits(self.fitting_plan(cfg, length))

        def stride(length: int) -> int:
            return max(STEP, int(length * 0.03) // STEP * STEP)

        length = at(guess)
        # the line is usually right to a step: the length beside the guess settles it with one more plan
        if fits(length):
            if length >= limit or not fits(at(length + STEP)):
                return length
            lo, hi = at(length + STEP), None
            while lo < limit:
                nxt = at(lo + stride(lo))
                if not fits(nxt):
                    hi = nxt
                    break
                lo = nxt
            if hi is None:
                return lo
        else:
            if length > SHORTEST and fits(at(length - STEP)):
                return at(length - STEP)
            hi = length
            while True:
                if hi <= SHORTEST:
                    return 0
                lo = at(hi - stride(hi))
                if fits(lo):
                    break
                hi = lo
        while hi - lo > STEP:  # lo fits, hi does not
            mid = at((lo + hi) // 2)
            if mid in (lo, hi):
                break
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

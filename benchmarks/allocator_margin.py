"""The CUDA caching allocator's margin (max reserved − max allocated), modelled: each eager GPU-suite row's config is
planned on the CPU as ``replan_gpu_rows.py`` plans it, every device storage the planner counts (allocations,
resizes, frees, in order: ``mtune.training.planning.tracker.device_events``) is replayed through a model of the
allocator, and the modelled margin is set beside the one the GPU measured; then the smallest budget the model
serves the same log in, which is what a fit needs.

The model (:class:`CachingAllocatorModel`) follows the native allocator's rules as PyTorch's
``c10/cuda/CUDACachingAllocator.cpp`` states them, with ``expandable_segments`` off (as every suite row ran): each
stream has pools of its own (a block freed is reused only by its stream: the offloading techniques' side-stream
copies, marked in the log, draw on theirs); requests are rounded up to 512 bytes; those of at most 1 MiB come from
2 MiB segments (the small pool), the others from the large pool, whose new segments are 20 MiB for requests under
10 MiB and the request rounded up to 2 MiB otherwise; a request takes the smallest free block of its pool that
holds it (the lowest address among equal sizes), split when what remains is at least 512 bytes (small pool) or
over 1 MiB (large pool); a freed block merges with free neighbours of its segment. Without a limit segments are
never returned. Held to a limit (``torch.cuda.set_per_process_memory_fraction``), a new segment that would pass it
first makes the allocator wait for every stream's pending work and return every wholly free segment of every pool
(``release_cached_blocks``; ``release_available_cached_blocks`` does nothing at the default ``max_split_size``),
then try once more with a new segment, without searching the pools again; what still does not fit is an
out-of-memory error. A block freed while another stream still uses it (``record_stream``) goes back to its pool only
once the allocator sees that work done: at the start of a later request (``process_events``), or in that wait, which
returns every such block at once (``synchronize_and_free_events``). An allocator's own history lists both kinds of
return before the request they came in; the model takes a return of every outstanding block at once, at a request
no free block holds and a new segment would pass the limit, for the wait's (the allocator waits only then, and only
the wait returns them all), and any other for ``process_events``' (:meth:`CachingAllocatorModel.malloc`).

What it leaves out, and the rows show: the checkpoint's loading before the first step, kernels' and libraries'
buffers outside the tracked storages (a compiled kernel's, bitsandbytes' paged step, the host optimizer step's
transfers), frees deferred until another stream's work ends (the planner's log does not mark them: a block freed
while a side stream still reads it is reused only once that work is done, so an unlimited run reserves more while
the copies lag; an allocator's history marks them, :func:`trace_events`), and steps after the planner's two.
Compiled rows are left out: the planner plans them eagerly.

    python benchmarks/allocator_margin.py [--cases NAME ...]
    python benchmarks/allocator_margin.py --against-cuda    # on a GPU: the model beside the allocator itself
    python benchmarks/allocator_margin.py --compare PLAN RUN   # a traced GPU row's two request logs (JSON)

Prints a table and writes ``benchmarks/results/allocator_margin.json``; ``--against-cuda`` prints one JSON line.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MIB = 2**20
GIB = 2**30

MIN_BLOCK = 512          # every request is rounded up to a multiple of this
SMALL_REQUEST = MIB      # the largest request served by the small pool
SMALL_SEGMENT = 2 * MIB  # a small-pool segment
LARGE_SEGMENT = 20 * MIB  # a large-pool segment for requests under MIN_LARGE_ALONE
MIN_LARGE_ALONE = 10 * MIB  # requests from here get a segment of their own size, rounded up to ROUND_LARGE
ROUND_LARGE = 2 * MIB


class Block:
    """A run of bytes inside one segment: allocated or free, with its neighbours in the segment."""

    __slots__ = ("segment", "address", "size", "free", "prev", "next", "pool")

    def __init__(self, segment: int, address: int, size: int, pool: tuple[int, bool]):
        self.segment, self.address, self.size, self.pool = segment, address, size, pool
        self.free, self.prev, self.next = True, None, None


class Pending:
    """A block freed while another stream still uses it (:meth:`CachingAllocatorModel.free_requested`); ``done``
    once it is back in its pool."""

    __slots__ = ("block", "done")

    def __init__(self, block: Block):
        self.block, self.done = block, False


class CachingAllocatorModel:
    """The native caching allocator (module docstring). ``malloc(nbytes, stream)`` returns the block it hands out
    from ``stream``'s pools (0: the compute stream), ``free(block)`` takes it back; a block freed while another
    stream still uses it is ``free_requested(block)``, and ``free_completed`` of what that returns once the allocator
    has seen that work done (it is reused from the next request on, or sooner if a wait returns it: module
    docstring). ``allocated``, ``reserved`` and their peaks are in bytes, as ``torch.cuda.memory_allocated`` /
    ``memory_reserved`` and their ``max_`` forms count them (a block handed out whole counts whole, its unsplit
    remainder included; a block counts as freed when its free is requested); ``max_requested`` is the peak of the
    bytes asked for."""

    def __init__(self, limit: int | None = None):
        self.limit = limit  # bytes the segments may take in all (set_per_process_memory_fraction); None: no limit
        self._free: dict[tuple[int, bool], list] = {}  # (stream, small pool?) -> sorted (size, address, block)
        self._asked: dict[int, int] = {}  # id(block) -> the bytes asked for
        self._next_address = 0  # segments released under a limit leave gaps: addresses only ever grow
        self.allocated = self.reserved = self.max_allocated = self.max_reserved = 0
        self.requested = self.max_requested = self.segments = self.retries = self.served = 0
        self._pending: dict[int, Pending] = {}  # id(pending) -> blocks freed whose streams' work is not yet seen done
        self._returned: list[Pending] = []  # of those, the ones seen done since the last request

    @staticmethod
    def rounded(nbytes: int) -> int:
        return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)

    @staticmethod
    def segment_size(size: int) -> int:
        if size <= SMALL_REQUEST:
            return SMALL_SEGMENT
        if size < MIN_LARGE_ALONE:
            return LARGE_SEGMENT
        return -(-size // ROUND_LARGE) * ROUND_LARGE

    def _cache(self, block: Block) -> None:
        block.free = True
        bisect.insort(self._free[block.pool], (block.size, block.address, block))

    def _uncache(self, block: Block) -> None:
        pool = self._free[block.pool]
        pool.pop(bisect.bisect_left(pool, (block.size, block.address)))

    def malloc(self, nbytes: int, stream: int = 0) -> Block:
        size = self.rounded(nbytes)
        key = (stream, size <= SMALL_REQUEST)
        small, pool = key[1], self._free.setdefault(key, [])
        whole = self.segment_size(size)
        returned, self._returned = self._returned, []
        # every outstanding block returned at once, at a request nothing free holds and no new segment fits: the
        # allocator's wait returned them, after its search of the pools failed (module docstring)
        waited = (bool(returned) and not self._pending and self.limit is not None and self.reserved + whole > self.limit
                  and bisect.bisect_left(pool, (size, -1)) == len(pool))
        for pending in returned:
            self._cache_merged(pending.block)
        found = len(pool) if waited else bisect.bisect_left(pool, (size, -1))
        if found < len(pool):
            block = pool.pop(found)[2]
        else:  # a new segment (cudaMalloc)
            if self.limit is not None and self.reserved + whole > self.limit:
                # over the limit: wait for every stream's pending work, return each wholly free segment
                # (release_cached_blocks), then try a new segment once more, without searching the pools again: a
                # split segment cannot be returned, and a block the wait returned is not taken for this request
                self.retries += 1
                for pending in list(self._pending.values()):
                    self.free_completed(pending)
                for pending in self._returned:
                    self._cache_merged(pending.block)
                self._returned = []
                self._release_free_segments()
                if self.reserved + whole > self.limit:
                    raise ModelledOutOfMemory(f"{nbytes} bytes asked with {self.reserved} reserved of a "
                                              f"{self.limit}-byte limit")
            address, self._next_address = self._next_address, self._next_address + whole
            block = Block(address, address, whole, key)
            self.reserved += whole
            self.segments += 1
            self.max_reserved = max(self.max_reserved, self.reserved)
        remaining = block.size - size
        if (remaining >= MIN_BLOCK) if small else (remaining > SMALL_REQUEST):
            rest = Block(block.segment, block.address + size, remaining, key)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._cache(rest)
        block.free = False
        self.allocated += block.size
        self.max_allocated = max(self.max_allocated, self.allocated)
        self._asked[id(block)] = nbytes
        self.requested += nbytes
        self.served += 1
        self.max_requested = max(self.max_requested, self.requested)
        return block

    def free(self, block: Block) -> None:
        self.allocated -= block.size
        self.requested -= self._asked.pop(id(block))
        self._cache_merged(block)

    def free_requested(self, block: Block) -> Pending:
        """``block`` freed while another stream still uses it (``record_stream``): counted as freed, but not reused
        until :meth:`free_completed` of what this returns."""
        self.allocated -= block.size
        self.requested -= self._asked.pop(id(block))
        pending = Pending(block)
        self._pending[id(pending)] = pending
        return pending

    def free_completed(self, pending: Pending) -> None:
        """The allocator has seen the work on ``pending``'s block done: the block is its pool's again from the next
        request on (nothing, if a wait for the streams already returned it)."""
        if not pending.done:
            pending.done = True
            del self._pending[id(pending)]
            self._returned.append(pending)

    def _cache_merged(self, block: Block) -> None:
        for neighbour in (block.prev, block.next):
            if neighbour is None or not neighbour.free:
                continue
            self._uncache(neighbour)
            first, second = (neighbour, block) if neighbour is block.prev else (block, neighbour)
            first.size += second.size
            first.next = second.next
            if second.next is not None:
                second.next.prev = first
            block = first
        self._cache(block)

    def _release_free_segments(self) -> None:
        for pool in self._free.values():
            whole = [entry for entry in pool if entry[2].prev is None and entry[2].next is None]
            for entry in whole:
                pool.remove(entry)
                self.reserved -= entry[2].size
                self.segments -= 1


class ModelledOutOfMemory(RuntimeError):
    """The model could not serve a request within its limit: the allocator would raise ``OutOfMemoryError``."""


def replay(events: list[tuple[str, int, int, int]], streams: bool = True,
           limit: int | None = None) -> CachingAllocatorModel:
    """The allocator model after ``events`` (`device_events`' form; a resize frees the storage's block and takes
    one of its new size, as re-growing an emptied storage does; an allocator's history, :func:`trace_events`, also
    has ``("free_requested", key, 0, stream)`` for a block freed while another stream still used it, whose
    ``free`` then says when the allocator saw that work done). ``streams=False``: every allocation from the
    compute stream's pools; ``limit``: the segments' bytes are held to it (raises :class:`ModelledOutOfMemory`)."""
    return feed(CachingAllocatorModel(limit), events, streams)


def feed(model: CachingAllocatorModel, events: list[tuple[str, int, int, int]],
         streams: bool = True) -> CachingAllocatorModel:
    """``events`` through ``model`` (:func:`replay`); a request it refuses raises :class:`ModelledOutOfMemory`, with
    ``model.served`` requests served before it."""
    live: dict = {}  # key -> its block, or what free_requested returned for it
    for kind, key, nbytes, stream in events:
        if kind == "free_requested" and live.get(key) is not None:
            live[key] = model.free_requested(live[key])
        if kind in ("free", "resize") and live.get(key) is not None:
            held = live.pop(key)
            model.free_completed(held) if isinstance(held, Pending) else model.free(held)
        if kind in ("alloc", "resize"):
            live[key] = model.malloc(nbytes, stream if streams else 0) if nbytes else None
    return model


def smallest_budget(events: list[tuple[str, int, int, int]]) -> CachingAllocatorModel:
    """The model replayed under the smallest limit, in 2 MiB steps (segments come in them), that serves every
    request of ``events``: found by bisection between the peak of allocated bytes and the peak reserved without a
    limit, taking "serves under L" to hold for every limit above L (checked by brute force on the tests'
    sequences). Its ``limit`` is that budget; its ``retries``, how often the allocator had to wait for the streams
    and return free segments on the way."""
    free_run = replay(events)
    low = -(-free_run.max_allocated // ROUND_LARGE)
    high = -(-free_run.max_reserved // ROUND_LARGE)  # serves: nothing reserved past it without a limit
    while low < high:
        middle = (low + high) // 2
        try:
            replay(events, limit=middle * ROUND_LARGE)
            high = middle
        except ModelledOutOfMemory:
            low = middle + 1
    return replay(events, limit=high * ROUND_LARGE)


def trace_events(trace: list[dict]) -> list[tuple[str, int, int, int]]:
    """A CUDA allocator's own history (``torch.cuda.memory._snapshot()["device_traces"][i]``, recorded with
    ``_record_memory_history``) as :func:`replay`'s events: each ``alloc`` (the bytes asked, on its stream), each
    ``free_completed`` as ``free`` (when the block was back in its pool), and before it, for a block freed while
    another stream still used it (``record_stream``), its ``free_requested``: the allocator records that at the free
    and the completion only once it sees the other stream's work done, where a plain free records the two together
    (so one seen done at once, with nothing recorded between, reads as a plain free). Segment events are the
    allocator's doing, not requests."""
    events = []
    for entry, following in zip(trace, trace[1:] + [None]):
        if entry["action"] == "alloc":
            events.append(("alloc", entry["addr"], entry["size"], entry["stream"]))
        elif entry["action"] == "free_completed":
            events.append(("free", entry["addr"], 0, 0))
        elif entry["action"] == "free_requested" and (following is None or following["action"] != "free_completed"
                                                      or following["addr"] != entry["addr"]):
            events.append(("free_requested", entry["addr"], 0, entry["stream"]))
    return events


def save_requests(path: Path, events: list[tuple[str, int, int, int]]) -> None:
    """Write a request log (:func:`replay`'s events: a plan's ``device_events`` or :func:`trace_events` of a run) to
    ``path`` as gzipped JSON, each storage's key renumbered in order of first use: ``[[kind, key, bytes, stream],
    ...]``. A GPU row keeps both of a traced run, for :func:`compare_requests` on a CPU afterwards."""
    import gzip

    keys: dict[int, int] = {}
    compact = [[kind, keys.setdefault(key, len(keys)), nbytes, stream] for kind, key, nbytes, stream in events]
    with gzip.open(path, "wt") as sink:
        json.dump(compact, sink, separators=(",", ":"))


def load_requests(path: Path) -> list[tuple[str, int, int, int]]:
    """A log :func:`save_requests` wrote."""
    import gzip

    with gzip.open(path, "rt") as source:
        return [tuple(event) for event in json.load(source)]


def compare_requests(plan: list[tuple[str, int, int, int]], run: list[tuple[str, int, int, int]],
                     top: int = 10) -> dict:
    """Where a plan's requests and a run's part (each a log of :func:`replay`'s events): how many requests and bytes
    each asks, the first request whose size differs (its index and both sizes), and the request sizes the run asks
    more often than the plan, and the plan more often than the run (``top`` of each, the most bytes first:
    ``[size, count difference]``). What a run allocates that its plan does not (a kernel's transients) shows here."""
    from collections import Counter

    sizes = [[size for kind, _, size, _ in log if kind == "alloc"] for log in (plan, run)]
    first = next((i for i, (a, b) in enumerate(zip(*sizes)) if a != b), min(map(len, sizes)))
    counts = [Counter(log) for log in sizes]
    extra = [sorted(((size, n) for size, n in (a - b).items()), key=lambda item: -item[0] * item[1])[:top]
             for a, b in ((counts[1], counts[0]), (counts[0], counts[1]))]
    return {"plan_requests": len(sizes[0]), "run_requests": len(sizes[1]),
            "plan_requested_bytes": sum(sizes[0]), "run_requested_bytes": sum(sizes[1]),
            "first_difference": {"request": first, "plan": sizes[0][first] if first < len(sizes[0]) else None,
                                 "run": sizes[1][first] if first < len(sizes[1]) else None},
            "run_more_often": [list(item) for item in extra[0]], "plan_more_often": [list(item) for item in extra[1]]}


def model_on_trace(trace: list[dict], limit: int | None = None,
                   events: list[tuple[str, int, int, int]] | None = None) -> dict:
    """The model replayed on the allocator's own history (``events``: :func:`trace_events` of it, made here when not
    given), held to ``limit`` as the run was, beside what that history says the allocator reserved (its
    ``segment_alloc`` and ``segment_free`` entries): how exact the model is on a real run's requests, apart from how
    exact the plan's requests are. Bytes."""
    reserved = peak = segment_frees = 0
    for entry in trace:
        if entry["action"] == "segment_alloc":
            reserved += entry["size"]
            peak = max(peak, reserved)
        elif entry["action"] == "segment_free":
            reserved -= entry["size"]
            segment_frees += 1
    events, model, refused = trace_events(trace) if events is None else events, CachingAllocatorModel(limit), None
    try:
        feed(model, events)
    except ModelledOutOfMemory:  # the model as it was when it refused
        refused = model.served
    return {"trace_requests": sum(kind == "alloc" for kind, *_ in events), "trace_max_reserved": peak,
            "trace_segment_frees": segment_frees, "trace_out_of_memory": any(e["action"] == "oom" for e in trace),
            "model_max_reserved": model.max_reserved,
            "model_max_allocated": model.max_allocated, "model_retries": model.retries,
            "model_refused_request": refused}


SEQUENCE = (100, MIB, MIB, 3 * MIB, 16 * MIB, 30 * MIB, 24 * MIB, 10 * MIB + 1, 700 * 1024, 5 * MIB)
"""Requests (bytes) of the check against the allocator itself: both pools, both large-segment kinds, best fit, a
block handed out whole; after request i the requests of ``SEQUENCE_FREES[i]`` are freed."""
SEQUENCE_FREES = {2: (0,), 5: (3, 4), 7: (5,), 9: (1, 7)}
HELD_SEQUENCE = (30 * MIB, 24 * MIB, 32 * MIB, 3 * MIB)
"""Requests of the check under a limit: the third fits no free block and, over the limit, is served only once the
first's freed segment is returned; the fourth needs a 20 MiB segment, and nothing then free can be returned."""
HELD_FREES = {1: (0,)}
HELD_LIMITS = (64 * MIB, 76 * MIB)
"""64 MiB: the fourth request is refused; 76 MiB (:func:`smallest_budget` of the sequence): all are served."""


def run_sequence(malloc, free, sequence, frees) -> int | None:
    """Requests ``sequence`` through ``malloc``, freeing after request i those of ``frees[i]``; the index of the
    request refused (``malloc`` raised an out-of-memory error), or None."""
    import torch

    held = {}
    for i, nbytes in enumerate(sequence):
        try:
            held[i] = malloc(nbytes)
        except (ModelledOutOfMemory, torch.OutOfMemoryError):
            return i
        for j in frees.get(i, ()):
            free(held.pop(j))
    return None


def against_cuda() -> dict:
    """:data:`SEQUENCE` through the model and through ``torch.cuda``'s allocator, from a process whose allocator
    holds nothing yet (run it in a fresh process, ``PYTORCH_CUDA_ALLOC_CONF`` without expandable segments): each
    side's peaks of allocated and reserved bytes; then :data:`HELD_SEQUENCE` under each of :data:`HELD_LIMITS`
    (``set_per_process_memory_fraction``): the request refused, the peak reserved and the retries, and the
    allocator's recorded history of that run through :func:`model_on_trace`."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("--against-cuda needs a CUDA GPU (torch.cuda.is_available() is False here)")
    torch.cuda.init()
    base_allocated, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    model = CachingAllocatorModel()
    real: list = []
    run_sequence(lambda n: real.append(torch.empty(n, dtype=torch.uint8, device="cuda")) or len(real) - 1,
                 lambda i: real.__setitem__(i, None), SEQUENCE, SEQUENCE_FREES)
    run_sequence(model.malloc, model.free, SEQUENCE, SEQUENCE_FREES)
    figures = {"cuda": {"max_allocated": torch.cuda.max_memory_allocated() - base_allocated,
                        "max_reserved": torch.cuda.max_memory_reserved() - base_reserved},
               "model": {"max_allocated": model.max_allocated, "max_reserved": model.max_reserved},
               "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    total = torch.cuda.get_device_properties(0).total_memory
    for limit in HELD_LIMITS:
        real.clear()
        torch.cuda.empty_cache()  # nothing cached: the limit counts this sequence's segments only
        torch.cuda.reset_peak_memory_stats()
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        # a few KiB over: the allocator takes fraction x total, rounded down; segments come in 2 MiB steps
        torch.cuda.set_per_process_memory_fraction((limit + 4096) / total)
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python")
        start = len(torch.cuda.memory._snapshot()["device_traces"][0])  # the history before this run, if kept
        refused = run_sequence(lambda n: real.append(torch.empty(n, dtype=torch.uint8, device="cuda")) or len(real) - 1,
                               lambda i: real.__setitem__(i, None), HELD_SEQUENCE, HELD_FREES)
        trace = torch.cuda.memory._snapshot()["device_traces"][0][start:]
        torch.cuda.memory._record_memory_history(enabled=None)
        torch.cuda.set_per_process_memory_fraction(1.0)
        model = CachingAllocatorModel(limit)
        modelled_refused = run_sequence(model.malloc, model.free, HELD_SEQUENCE, HELD_FREES)
        figures[f"held_to_{limit // MIB}_mib"] = {
            "cuda": {"refused": refused, "max_reserved": torch.cuda.max_memory_reserved() - base_reserved,
                     "retries": torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries},
            "model": {"refused": modelled_refused, "max_reserved": model.max_reserved, "retries": model.retries},
            # the same run's own history, replayed: what the suite's traced rows do with a training run's
            "trace": model_on_trace(trace, limit)}
    return figures


def modelled(case, suite, api) -> dict:
    """``case`` (a ``gpu_suite.Case``) planned with its device storages recorded, replayed through the model."""
    from mtune.training.planning.tracker import device_events
    from replan_gpu_rows import case_plan_config

    cfg, reason = case_plan_config(case, suite, api)
    if cfg is None:
        return {"status": "skipped", "reason": reason}
    start = time.process_time()
    with device_events() as events:
        plan = api.plan_memory(cfg)
    model, one_stream, held = replay(events), replay(events, streams=False), smallest_budget(events)
    return {"status": "ok", "planned_allocated_gib": plan.device_peak_bytes / GIB,
            "modelled_smallest_budget_gib": held.limit / GIB,
            "modelled_held_margin_gib": (held.limit - held.max_requested) / GIB, "held_retries": held.retries,
            "fit_margin_gib": (suite.fit_margin_limit(api, plan) - plan.device_peak_bytes) / GIB,
            "side_stream_allocations": sum(1 for event in events if event[3] and event[2]),
            "modelled_margin_one_stream_gib": (one_stream.max_reserved - one_stream.max_allocated) / GIB,
            "modelled_requested_gib": model.max_requested / GIB, "modelled_allocated_gib": model.max_allocated / GIB,
            "modelled_reserved_gib": model.max_reserved / GIB,
            "modelled_margin_gib": (model.max_reserved - model.max_allocated) / GIB, "segments": model.segments,
            "events": len(events), "cpu_s": round(time.process_time() - start, 1)}


def table(rows: list[dict]) -> str:
    """docs/benchmarks.md's table: the measured margin, the modelled one, the model with every allocation on the
    compute stream; the smallest budget the model serves less the plan's peak, beside the margin ``--fit`` leaves
    at the tightest budget it accepts for the plan ("–": a row not planned)."""
    lines = ["| case | measured reserved − allocated (GiB) | modelled (GiB) | modelled on one stream (GiB) | "
             "modelled smallest budget − plan (GiB) | --fit's margin there (GiB) |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        figures = (r["measured_margin_gib"], r.get("modelled_margin_gib"), r.get("modelled_margin_one_stream_gib"),
                   r.get("modelled_held_margin_gib"), r.get("fit_margin_gib"))
        lines.append(f"| {r['case']} | " + " | ".join("–" if f is None else f"{f:.2f}" for f in figures) + " |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", help="only these cases (default: every eager run row measured)")
    parser.add_argument("--out", type=Path, default=RESULTS / "allocator_margin.json")
    parser.add_argument("--against-cuda", action="store_true",
                        help="instead: the model beside this GPU's allocator on a fixed sequence (prints JSON)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("PLAN", "RUN"),
                        help="instead: compare a traced row's plan and run request logs (*.requests.json.gz)")
    args = parser.parse_args(argv)
    if args.compare:
        figures = compare_requests(*map(load_requests, args.compare))
        print(json.dumps(figures, indent=1))
        return [figures]
    if args.against_cuda:
        figures = against_cuda()
        print(json.dumps(figures))
        return [figures]
    sys.path.insert(0, str(HERE))
    import gpu_suite
    from replan_gpu_rows import latest_run_rows, write_rows

    api = gpu_suite.mtune_api()
    cases = {c.name: c for c in gpu_suite.CASES}
    measured = [r for r in latest_run_rows(json.loads((RESULTS / "gpu_suite.json").read_text())["rows"], args.cases)
                if not r["compile"] and r.get("max_reserved_gib")]
    rows = []
    for row in measured:
        rows.append({"case": row["case"], "gpu_name": row["gpu_name"], "measured_date": row["date"],
                     "max_allocated_gib": row["max_allocated_gib"], "max_reserved_gib": row["max_reserved_gib"],
                     "measured_margin_gib": row["max_reserved_gib"] - row["max_allocated_gib"],
                     **modelled(cases[row["case"]], gpu_suite, api)})
        if rows[-1]["status"] == "ok":  # --fit's margin less the model's need, then less what the run allocated
            ok = rows[-1]  # beyond its plan as well (the plan made now, the run measured then)
            ok["run_over_plan_gib"] = ok["max_allocated_gib"] - ok["planned_allocated_gib"]
            ok["fit_spare_gib"] = ok["fit_margin_gib"] - ok["modelled_held_margin_gib"]
            ok["fit_spare_after_run_gib"] = ok["fit_spare_gib"] - ok["run_over_plan_gib"]
        print(f"{row['case']}: modelled margin {rows[-1].get('modelled_margin_gib', float('nan')):.2f} GiB, "
              f"measured {rows[-1]['measured_margin_gib']:.2f}", flush=True)
    print(table(rows))
    write_rows(args.out, rows)
    return rows


if __name__ == "__main__":
    main()

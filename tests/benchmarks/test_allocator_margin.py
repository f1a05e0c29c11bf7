"""benchmarks/allocator_margin.py: the caching-allocator model against the allocator's rules worked by hand (and, on
a GPU, against the allocator itself), and the planner's device storages replayed through it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._helpers.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
MIB = 2**20

margin = load_script("allocator_margin", "benchmarks")


def test_small_requests_share_2_mib_segments_until_one_does_not_fit():
    model = margin.CachingAllocatorModel()
    model.malloc(100)  # rounded up to 512 bytes, in a new 2 MiB segment
    assert (model.allocated, model.reserved) == (512, 2 * MIB)
    model.malloc(MIB)  # the largest small request: the rest of that segment holds it
    assert (model.allocated, model.reserved) == (512 + MIB, 2 * MIB)
    model.malloc(MIB)  # 1 MiB - 512 bytes left there: a second segment
    assert (model.allocated, model.reserved, model.segments) == (512 + 2 * MIB, 4 * MIB, 2)


def test_large_requests_split_20_mib_segments_and_an_unsplit_remainder_counts_as_allocated():
    model = margin.CachingAllocatorModel()
    a = model.malloc(3 * MIB)  # under 10 MiB: a 20 MiB segment, split (17 MiB left, over 1 MiB)
    assert (model.allocated, model.reserved) == (3 * MIB, 20 * MIB)
    b = model.malloc(16 * MIB)  # takes the 17 MiB block whole: 1 MiB left is not over 1 MiB, so not split
    assert (b.size, model.allocated, model.reserved) == (17 * MIB, 20 * MIB, 20 * MIB)
    assert model.requested == 19 * MIB
    model.free(a)
    model.free(b)  # the two merge back into one free block: a 19 MiB request needs no new segment
    assert model.malloc(19 * MIB).size == 20 * MIB and model.reserved == 20 * MIB  # 1 MiB left: whole again
    model.malloc(10 * MIB + 1)  # from 10 MiB: a segment of its own, rounded up to 2 MiB
    assert model.reserved == 20 * MIB + 12 * MIB and model.max_allocated == 20 * MIB + 10 * MIB + 512


def test_the_smallest_free_block_that_fits_is_taken_and_fragmentation_reserves_more():
    model = margin.CachingAllocatorModel()
    big, small = model.malloc(30 * MIB), model.malloc(24 * MIB)
    model.free(big)
    model.free(small)
    chosen = model.malloc(22 * MIB)  # the 24 MiB block, split (2 MiB left), not the 30 MiB one
    assert chosen.segment == small.segment and chosen.size == 22 * MIB
    # 30 MiB free in one segment and 2 MiB in another: a 31 MiB request takes a new segment
    model.malloc(31 * MIB)
    assert (model.reserved, model.max_allocated, model.segments) == (86 * MIB, 54 * MIB, 3)


def test_replay_frees_resizes_and_reuses():
    events = [("alloc", 1, 12 * MIB, 0), ("alloc", 2, 12 * MIB, 0), ("resize", 1, 0, 0), ("alloc", 3, 14 * MIB, 0),
              ("resize", 1, 12 * MIB, 0), ("free", 2, 0, 0), ("free", 3, 0, 0), ("alloc", 4, 26 * MIB, 0)]
    model = margin.replay(events)
    # 1's emptied block cannot hold 3 (14 MiB): a third segment; re-filling 1 takes its old block back; 4 (26 MiB)
    # fits no free block (12 and 14 MiB, in two segments): a fourth
    assert (model.reserved, model.max_allocated, model.allocated) == (64 * MIB, 38 * MIB, 38 * MIB)


def test_each_stream_reuses_only_the_blocks_it_freed():
    model = margin.CachingAllocatorModel()
    side = model.malloc(12 * MIB, stream=1)  # a side stream's copy: a 12 MiB segment of that stream's
    model.free(side)
    model.malloc(12 * MIB)  # the compute stream cannot take it: a segment of its own
    assert model.reserved == 24 * MIB
    again = model.malloc(12 * MIB, stream=1)  # the side stream takes its block back
    assert again.segment == side.segment and model.reserved == 24 * MIB
    # one stream for all: the block is reused and nothing more is reserved
    events = [("alloc", 1, 12 * MIB, 1), ("free", 1, 0, 0), ("alloc", 2, 12 * MIB, 0)]
    assert (margin.replay(events).reserved, margin.replay(events, streams=False).reserved) == (24 * MIB, 12 * MIB)


def test_held_to_a_limit_free_segments_are_returned_before_a_request_is_refused():
    # HELD_SEQUENCE: 30 MiB and 24 MiB (segments of their own), the 30 freed, then 32 MiB, then 3 MiB
    requests = margin.HELD_SEQUENCE
    free = margin.CachingAllocatorModel()  # no limit: the freed 30 MiB is kept, and the 3 MiB request splits it
    assert margin.run_sequence(free.malloc, free.free, requests, margin.HELD_FREES) is None
    assert (free.max_reserved, free.retries, free.segments) == (86 * MIB, 0, 3)
    served = margin.CachingAllocatorModel(76 * MIB)
    # 32 MiB fits no free block and 54 + 32 passes 76: the freed 30 MiB segment is returned (one retry), 24 + 32
    # reserved; the 3 MiB request's 20 MiB segment then fits exactly
    assert margin.run_sequence(served.malloc, served.free, requests, margin.HELD_FREES) is None
    assert (served.max_reserved, served.reserved, served.retries, served.segments) == (76 * MIB, 76 * MIB, 1, 3)
    refused = margin.CachingAllocatorModel(64 * MIB)
    # at 64 MiB the 3 MiB request is refused: nothing free is left to return (a second retry)
    assert margin.run_sequence(refused.malloc, refused.free, requests, margin.HELD_FREES) == 3
    assert (refused.max_reserved, refused.retries) == (56 * MIB, 2)


def test_a_split_segment_is_not_returned_while_part_of_it_is_held():
    model = margin.CachingAllocatorModel(30 * MIB)
    kept, freed = model.malloc(3 * MIB), model.malloc(5 * MIB)  # one 20 MiB segment, split
    model.free(freed)  # 17 MiB free in it, beside the 3 MiB kept
    with pytest.raises(margin.ModelledOutOfMemory):
        model.malloc(18 * MIB)  # fits no free block; 20 + 18 passes 30, and the split segment cannot be returned
    assert kept.size == 3 * MIB and model.reserved == 20 * MIB and model.retries == 1
    model.free(kept)  # the segment is whole and free again: it holds the request, with no new segment
    model.malloc(18 * MIB)
    assert (model.reserved, model.segments, model.retries) == (20 * MIB, 1, 1)


def _events(requests, frees):
    events = []
    for i, nbytes in enumerate(requests):
        events.append(("alloc", i, nbytes, 0))
        events += [("free", j, 0, 0) for j in frees.get(i, ())]
    return events


@pytest.mark.parametrize("requests, frees", [
    (margin.HELD_SEQUENCE, margin.HELD_FREES),
    (margin.SEQUENCE, margin.SEQUENCE_FREES),
    ((12 * MIB, 3 * MIB, 40 * MIB, 5 * MIB, 12 * MIB, 700 * 1024, 22 * MIB), {1: (0,), 3: (2,), 5: (1, 4)}),
])
def test_the_smallest_budget_is_the_least_limit_that_serves_every_request(requests, frees):
    events = _events(requests, frees)
    held = margin.smallest_budget(events)

    def serves(limit):
        try:
            margin.replay(events, limit=limit)
            return True
        except margin.ModelledOutOfMemory:
            return False

    steps = range(0, margin.replay(events).max_reserved + 2 * MIB, 2 * MIB)  # every limit, by brute force
    assert [limit for limit in steps if serves(limit)] == list(range(held.limit, steps[-1] + 1, 2 * MIB))
    assert held.max_reserved <= held.limit


def _entry(action, addr, size, stream=7):
    return {"action": action, "addr": addr, "size": size, "stream": stream, "frames": []}


def test_the_model_replays_an_allocators_own_history():
    # HELD_SEQUENCE as the CUDA allocator records it under a 76 MiB limit (torch.cuda.memory._snapshot()'s
    # device_traces): its segments, its requests, the first block freed and its segment returned for the third
    a, b, c, d = 0x1000000, 0x3000000, 0x5000000, 0x7000000
    trace = [_entry("segment_alloc", a, 30 * MIB), _entry("alloc", a, 30 * MIB),
             _entry("segment_alloc", b, 24 * MIB), _entry("alloc", b, 24 * MIB),
             _entry("free_requested", a, 30 * MIB), _entry("free_completed", a, 30 * MIB),
             _entry("segment_free", a, 30 * MIB), _entry("segment_alloc", c, 32 * MIB), _entry("alloc", c, 32 * MIB),
             _entry("segment_alloc", d, 20 * MIB), _entry("alloc", d, 3 * MIB)]
    figures = margin.model_on_trace(trace, 76 * MIB)
    assert figures == {"trace_requests": 4, "trace_max_reserved": 76 * MIB, "trace_segment_frees": 1,
                       "trace_out_of_memory": False, "model_max_reserved": 76 * MIB,
                       "model_max_allocated": (24 + 32 + 3) * MIB, "model_retries": 1, "model_refused_request": None}
    assert margin.model_on_trace(trace, 64 * MIB)["model_refused_request"] == 3  # the 3 MiB request, as on the GPU


def test_a_request_log_round_trips_and_a_plan_is_set_beside_its_run(tmp_path):
    """A traced GPU row keeps its plan's and its run's request logs; on a CPU, ``--compare`` says where they part.
    Here the run makes two 224 MiB transients its plan lacks (as a kernel outside the plan would), the first in
    place of the plan's third request. Worked by hand. Mutations seen failing: sizes counted from frees too, the
    two directions of the difference swapped, keys kept as given."""
    plan = [("alloc", 7001, MIB, 0), ("alloc", 9002, 2 * MIB, 1), ("free", 7001, 0, 0), ("alloc", 7003, 3 * MIB, 0)]
    run = [("alloc", 51, MIB, 0), ("alloc", 52, 2 * MIB, 1), ("free", 51, 0, 0), ("alloc", 53, 224 * MIB, 0),
           ("free", 53, 0, 0), ("alloc", 54, 224 * MIB, 0), ("alloc", 55, 3 * MIB, 0)]
    path = tmp_path / "case.plan.requests.json.gz"
    margin.save_requests(path, plan)
    assert margin.load_requests(path) == [("alloc", 0, MIB, 0), ("alloc", 1, 2 * MIB, 1), ("free", 0, 0, 0),
                                          ("alloc", 2, 3 * MIB, 0)]
    assert margin.compare_requests(margin.load_requests(path), run) == {
        "plan_requests": 3, "run_requests": 5, "plan_requested_bytes": 6 * MIB, "run_requested_bytes": 454 * MIB,
        "first_difference": {"request": 2, "plan": 3 * MIB, "run": 224 * MIB},
        "run_more_often": [[224 * MIB, 2]], "plan_more_often": []}
    # the plan asking what the run does not is the other list; a shorter log ends the comparison where it ends
    assert margin.compare_requests(run, plan)["plan_more_often"] == [[224 * MIB, 2]]
    assert margin.compare_requests(plan[:2], plan)["first_difference"] == {"request": 2, "plan": None,
                                                                             "run": 3 * MIB}


def test_a_block_freed_under_record_stream_returns_to_its_pool_when_the_allocator_says_so():
    # 12 MiB freed while a side stream still reads it (free_requested, its completion later), a second 12 MiB then
    # takes a new segment and is freed plainly (requested and completed together: one event); once the first free
    # completes, a third reuses a block
    trace = [_entry("alloc", 1, 12 * MIB), _entry("free_requested", 1, 12 * MIB), _entry("alloc", 2, 12 * MIB),
             _entry("free_requested", 2, 12 * MIB), _entry("free_completed", 2, 12 * MIB),
             _entry("free_completed", 1, 12 * MIB), _entry("alloc", 3, 12 * MIB)]
    assert margin.trace_events(trace) == [("alloc", 1, 12 * MIB, 7), ("free_requested", 1, 0, 7),
                                          ("alloc", 2, 12 * MIB, 7), ("free", 2, 0, 0), ("free", 1, 0, 0),
                                          ("alloc", 3, 12 * MIB, 7)]
    figures = margin.model_on_trace(trace)
    # counted as freed at the request, as torch.cuda.memory_allocated counts it: never more than 12 MiB at once
    assert (figures["model_max_reserved"], figures["model_max_allocated"]) == (24 * MIB, 12 * MIB)


def test_a_block_the_allocators_wait_returns_is_not_searched_for_the_request_that_waited():
    """CUDACachingAllocator's malloc: the pools are searched once, after ``process_events``; a new segment over the
    limit makes ``release_cached_blocks`` synchronize (every block freed under ``record_stream`` back in its pool),
    return every wholly free segment and try a new segment again, with no second search. The history lists the
    wait's returns before the request, like ``process_events``'; the model reads a return of every outstanding block
    at a request that would otherwise pass the limit as the wait's. Seen failing with the returns searched first:
    the 40 MiB segment split for the 20, and the 30 refused.

    Here, held to 64 MiB: 40 MiB freed while a side stream still reads it, then 12 MiB (segments of their own), 20
    and 30. The 20 fits no free block (the 40 is not back) and 52 + 20 passes 64: the wait returns the 40, its
    wholly free segment goes, a 20 MiB one is taken (12 + 20); the 30 then fits (62)."""
    a, b, c, d = 0x1000000, 0x4000000, 0x6000000, 0x8000000
    trace = [_entry("segment_alloc", a, 40 * MIB), _entry("alloc", a, 40 * MIB), _entry("free_requested", a, 40 * MIB),
             _entry("segment_alloc", b, 12 * MIB), _entry("alloc", b, 12 * MIB),
             _entry("free_completed", a, 40 * MIB), _entry("segment_free", a, 40 * MIB),
             _entry("segment_alloc", c, 20 * MIB), _entry("alloc", c, 20 * MIB),
             _entry("segment_alloc", d, 30 * MIB), _entry("alloc", d, 30 * MIB)]
    figures = margin.model_on_trace(trace, 64 * MIB)
    assert figures == {"trace_requests": 4, "trace_max_reserved": 62 * MIB, "trace_segment_frees": 1,
                       "trace_out_of_memory": False, "model_max_reserved": 62 * MIB,
                       "model_max_allocated": 62 * MIB, "model_retries": 1, "model_refused_request": None}
    model = margin.replay(margin.trace_events(trace), limit=64 * MIB)
    assert (model.reserved, model.segments, model.allocated) == (62 * MIB, 3, 62 * MIB)
    # with no limit nothing waits: the returned 40 MiB block is split for the 20, the 30 takes a segment of its own
    assert margin.replay(margin.trace_events(trace)).max_reserved == (40 + 12 + 30) * MIB


def test_a_return_that_leaves_another_block_outstanding_is_searched():
    # the wait returns every outstanding block at once; with the 12 MiB still read by the side stream, the 40's
    # return came from process_events at the start of the 20's request, whose search takes it
    events = [("alloc", 1, 40 * MIB, 0), ("alloc", 2, 12 * MIB, 0), ("alloc", 3, 12 * MIB, 0),
              ("free_requested", 1, 0, 0), ("free_requested", 2, 0, 0), ("free", 1, 0, 0), ("alloc", 4, 20 * MIB, 0)]
    model = margin.replay(events, limit=64 * MIB)
    assert (model.reserved, model.retries, model.segments, model.allocated) == (64 * MIB, 0, 3, 32 * MIB)


def test_the_wait_for_the_streams_returns_blocks_the_history_returns_later():
    model = margin.CachingAllocatorModel(64 * MIB)
    first, kept = model.malloc(40 * MIB), model.malloc(12 * MIB)
    pending = model.free_requested(first)  # the side stream's work not seen done yet
    assert model.allocated == 12 * MIB and model.reserved == 52 * MIB
    model.malloc(20 * MIB)  # 52 + 20 passes 64: the wait returns the 40, its segment goes, a new 20 is taken
    assert (model.reserved, model.retries, model.segments) == (32 * MIB, 1, 2)
    model.free_completed(pending)  # the completion the allocator would list now changes nothing
    model.malloc(30 * MIB)
    assert (model.reserved, model.allocated, model.segments) == (62 * MIB, 62 * MIB, 3)
    assert kept.size == 12 * MIB


def test_offloadings_side_stream_copies_are_logged_as_such():
    # Activation offloading copies saved tensors back in backward, and weight offloading prefetches the next group,
    # on a side stream on CUDA; planned in line, their allocations are marked so, and only theirs.
    rows = "tokenizer.max_seq_len=2048"  # the config's own: saved tensors over the 1 MiB offloading threshold
    _, events = _tiny_plan("llama3_2/1B_lora_single_device", rows, "enable_activation_offloading=true",
                           "activation_offloading_use_streams=true")
    side = [n for kind, _, n, stream in events if stream]
    assert side and all(kind in ("alloc", "resize") for kind, _, _, stream in events if stream)
    _, unstreamed = _tiny_plan("llama3_2/1B_lora_single_device", rows, "enable_activation_offloading=true",
                               "activation_offloading_use_streams=false")
    assert not any(stream for *_, stream in unstreamed)
    assert [(kind, n) for kind, _, n, _ in events] == [(kind, n) for kind, _, n, _ in unstreamed]
    _, prefetched = _tiny_plan("llama3_2/1B_lora_single_device",
                               "weight_offloading={type: block_level, use_streams: true}")
    assert any(kind == "resize" and n and stream for kind, _, n, stream in prefetched)


def _tiny_plan(config: str, *overrides: str):
    """``(plan, device events)`` of the shipped ``config`` on its family's tiny model for a CUDA target."""
    from mtune.training.planning.plan import plan_memory
    from mtune.training.planning.tracker import device_events
    from tests._helpers.shipped import shipped_on_tiny

    cfg = shipped_on_tiny(config, *overrides)[2]
    with device_events() as events:
        plan = plan_memory(cfg)
    return plan, events


def test_the_replayed_plan_allocates_what_the_plan_counts():
    # Every storage the planner counts goes through the model, and none twice: the peak of the bytes asked of it is
    # the plan's device peak.
    plan, events = _tiny_plan("llama3_2/1B_lora_single_device", "weight_offloading={type: leaf_level}")
    assert {kind for kind, *_ in events} == {"alloc", "resize", "free"}  # offloading empties, re-fills storages
    model = margin.replay(events)
    assert model.max_requested == plan.device_peak_bytes
    assert model.max_reserved >= model.max_allocated >= model.max_requested


def test_the_log_sees_every_nf4_dequantization_the_planner_would_replay(monkeypatch):
    # The planner replays torchao's NF4 dequantization as byte totals after its first call per shape; with the log
    # on, every call runs, so the log is that of a planner that never replays.
    from mtune.modules import nf4_dequantize
    from mtune.training.planning.replay import AllocationReplay

    monkeypatch.setattr(nf4_dequantize, "COMPILED_ON_CUDA", False)  # torchao's dequantization, as on the CPU
    _, logged = _tiny_plan("llama3_2/1B_qlora_single_device")
    monkeypatch.setattr(AllocationReplay, "__call__", lambda self, key, fn, device: fn())
    _, unreplayed = _tiny_plan("llama3_2/1B_qlora_single_device")
    assert [(kind, n) for kind, _, n, _ in logged] == [(kind, n) for kind, _, n, _ in unreplayed]
    assert sum(kind == "alloc" for kind, *_ in logged) > 1000


@pytest.mark.cuda
def test_the_model_counts_what_the_cuda_allocator_counts():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    # A process of its own: the allocator starts with no segment, and expandable segments off as the model assumes.
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    out = subprocess.run([sys.executable, "benchmarks/allocator_margin.py", "--against-cuda"], cwd=REPO, env=env,
                         capture_output=True, text=True, check=True).stdout
    figures = json.loads(out.splitlines()[-1])
    assert figures["cuda"] == figures["model"]
    for limit in margin.HELD_LIMITS:  # held to a memory fraction: the same request refused, peak and retries
        held = figures[f"held_to_{limit // MIB}_mib"]
        assert held["cuda"] == held["model"]
        trace = held["trace"]  # the allocator's own history of the run: its segments, and the model on its requests
        assert trace["model_max_reserved"] == trace["trace_max_reserved"] == held["cuda"]["max_reserved"]
        assert trace["trace_out_of_memory"] == (held["cuda"]["refused"] is not None)

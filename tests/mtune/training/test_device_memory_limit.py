"""device_memory_limit without a GPU: the byte tracker raises torch's out-of-memory error over the limit, the OOM
advice names the limit, CUDA gets the allocator fraction, and a misspelt size is one line naming the key."""

import pytest
import torch

from mtune.config.rules import check_device_memory_limit
from mtune.training.context import limit_cuda_memory
from mtune.training.memory.oom import OutOfMemory, oom_guard
from mtune.training.planning.tracker import TensorTracker
from mtune.units import MIB


def test_the_tracker_raises_torch_out_of_memory_over_the_limit():
    tracker = TensorTracker(device_limit=4 * MIB)
    with tracker:
        kept = torch.ones(512, 1024)  # 2 MiB: under the limit
        more = kept + 1                # 4 MiB live: at the limit, allowed
        with pytest.raises(torch.OutOfMemoryError, match="device_memory_limit: .* reached 6.0 MiB, over the limit of "
                                                         "4.0 MiB"):
            kept * 2
    assert tracker.take_interval().peak["device"] == 6 * MIB  # counted, then refused
    del more
    with TensorTracker():  # no limit: nothing refused
        torch.ones(4096, 1024)


def test_out_of_memory_over_the_limit_is_the_run_advice_with_the_limit(monkeypatch):
    monkeypatch.setattr("mtune.training.memory.oom._invocation", {})  # a recipe run in this process set its own
    cfg = {"recipe": "lora_single_device", "batch_size": 1, "device_memory_limit": "4MiB"}
    with pytest.raises(OutOfMemory) as err:
        with oom_guard("forward/backward and optimizer step", cfg):
            with TensorTracker(device_limit=4 * MIB):
                torch.ones(2048, 1024)
    message = str(err.value)
    assert message.startswith("out of memory during forward/backward and optimizer step (device_memory_limit: the "
                              "run's tensors on the device reached 8.0 MiB, over the limit of 4.0 MiB)")
    assert "mtune plan --fit --device-memory 4MiB lora_single_device" in message and "\n" not in message


def test_out_of_memory_advice_on_cuda_names_the_limit_as_it_binds(monkeypatch):
    """On a CUDA device of 80 GiB the fit command the error suggests is sized by the limit, but no more than the device
    (as out-of-memory recovery re-plans), and by the device without a limit. Mutation seen failing: the limit as
    written (--device-memory 100GiB)."""
    monkeypatch.setattr("mtune.training.memory.oom._invocation", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": 80 * 2**30}))
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved"):
        monkeypatch.setattr(torch.cuda, name, lambda: 0)
    for limit, size in (("100GiB", "80GiB"), ("20GiB", "20GiB"), (None, "80GiB")):
        cfg = {"recipe": "lora_single_device", "batch_size": 1, "device_memory_limit": limit}
        with pytest.raises(OutOfMemory) as err:
            with oom_guard("forward/backward and optimizer step", cfg):
                raise torch.OutOfMemoryError("CUDA out of memory")
        assert f"mtune plan --fit --device-memory {size} lora_single_device" in str(err.value), (limit, str(err.value))


def test_cuda_gets_the_allocator_fraction(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": 80 * 2**30}))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append((f, d)))
    limit_cuda_memory("20GiB", torch.device("cuda", 0))
    limit_cuda_memory(None, torch.device("cuda", 0))
    limit_cuda_memory("100GiB", torch.device("cuda", 0))  # more than the device: all of it
    assert calls == [(0.25, torch.device("cuda", 0)), (1.0, torch.device("cuda", 0))]


def test_the_budget_is_the_limit_as_it_binds(monkeypatch):
    """What out-of-memory recovery re-plans for: the limit, but no more than a CUDA device holds (on an H100 a limit
    of 83.6 GiB was planned for, on a 79.2 GiB card, 2026-11-26). Off CUDA the limit as written."""
    from mtune.training.memory.oom import device_memory_budget

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": 80 * 2**30}))
    assert device_memory_budget("100GiB", torch.device("cuda", 0)) == 80 * 2**30
    assert device_memory_budget("20GiB", "cuda:0") == 20 * 2**30
    assert device_memory_budget("100GiB", "cpu") == 100 * 2**30
    assert device_memory_budget(None, "cuda:0") is None


@pytest.mark.parametrize("value, problem", [
    ("20 gigs", "device_memory_limit='20 gigs': write a size such as 24GiB, 80GB or 512MiB (null: the whole device)"),
    ("0GiB", "device_memory_limit='0GiB' is 0 bytes, less than any run needs: write a size such as 24GiB (an int is "
             "bytes) (null: the whole device)"),
    ("24", "device_memory_limit='24' has no unit: write 24GiB, 24GB or 24MiB (a bare number would be bytes) "
           "(null: the whole device)"),
    (24, "device_memory_limit=24 is 24 bytes, less than any run needs: write a size such as 24GiB (an int is bytes) "
         "(null: the whole device)"),
])
def test_a_bad_limit_is_one_line_naming_the_key(value, problem):
    assert check_device_memory_limit({"device_memory_limit": value}) == [problem]
    assert check_device_memory_limit({"device_memory_limit": "20GiB"}) == []
    assert check_device_memory_limit({"device_memory_limit": 2**20}) == []  # an int of bytes, at least 1 MiB
    assert check_device_memory_limit({"device_memory_limit": None}) == []


def _batch(rows):
    return {"tokens": torch.arange(rows * 3).view(rows, 3), "labels": torch.arange(rows * 3).view(rows, 3),
            "num_tokens": torch.tensor(rows * 3 - 1)}


def test_halving_keeps_the_rows_in_order_and_the_token_count():
    from mtune.training.oom_recovery import halve_micro_batches

    halves = halve_micro_batches([_batch(4), _batch(2)])
    assert [int(h["tokens"].shape[0]) for h in halves] == [2, 2, 1, 1]
    assert torch.equal(torch.cat([h["tokens"] for h in halves[:2]]), _batch(4)["tokens"])
    assert [int(h["num_tokens"]) for h in halves] == [5, 6, 2, 3]
    assert halve_micro_batches([_batch(2), _batch(1)]) is None
    assert halve_micro_batches([{**_batch(4), "images": torch.zeros(4)}]) is None  # not a batch it knows


def test_a_preference_batch_is_halved_by_pairs():
    """2 pairs: rows 0-1 chosen, 2-3 rejected; each half holds one pair, its chosen row then its rejected row.
    Mutation seen failing: pairs split as rows (chosen rows in one half, rejected in the other)."""
    from mtune.training.oom_recovery import halve_micro_batches

    pairs = {**_batch(4), "pair_index": torch.tensor([7, 9]), "pairs_of": "x"}
    first, second = halve_micro_batches([pairs])
    assert torch.equal(first["tokens"], pairs["tokens"][[0, 2]]) and torch.equal(second["tokens"],
                                                                                pairs["tokens"][[1, 3]])
    assert torch.equal(first["labels"], pairs["labels"][[0, 2]])
    assert [int(first["pair_index"]), int(second["pair_index"])] == [7, 9] and first["pairs_of"] == "x"
    assert [int(first["num_tokens"]), int(second["num_tokens"])] == [5, 6]
    assert halve_micro_batches([{**_batch(2), "pair_index": torch.tensor([3]), "pairs_of": "x"}]) is None

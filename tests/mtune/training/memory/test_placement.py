import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mtune.training.placement import Placement


def test_a_cpu_only_placement_moves_nothing():
    p = Placement("cpu")
    t = torch.randn(4)
    assert not p.distinct and not p.pinned and not p.streams
    assert p.to_host(t) is t and p.to_compute(t) is t
    assert p.on_host(t)  # marked: offloaded tensors count as host memory even where that is the same memory


def test_a_distinct_placement_on_cpu_copies_and_tells_host_from_compute():
    p = Placement("cpu", distinct=True)
    t = torch.randn(4, 4)
    host = p.to_host(t)
    assert host.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() and torch.equal(host, t)
    assert p.on_host(host) and p.on_host(host[1:]) and not p.on_host(t) and p.on_compute(t)
    back = p.to_compute(host)
    assert torch.equal(back, t) and p.on_compute(back) and not p.on_host(back)
    del host
    assert not p._host_storages  # forgotten with the tensor


def test_host_storages_are_recognised_on_fake_tensors():
    p = Placement("cpu", distinct=True)
    with FakeTensorMode():
        t = torch.empty(1024, 1024)
        host = p.to_host(t)
        assert p.on_host(host) and not p.on_host(t)


def test_devices_that_differ_are_distinct():
    p = Placement("meta", "cpu")
    assert p.distinct and p.on_host(torch.zeros(1)) and p.on_compute(torch.empty(1, device="meta"))

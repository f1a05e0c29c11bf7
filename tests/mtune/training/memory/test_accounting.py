import contextlib
import json

import pytest
import torch

from mtune.models import build_model
from mtune.modules.loss import CrossEntropyLoss
from mtune.training.loop import train_step
from mtune.training.memory.tensor_bytes import tensor_storage_bytes
from mtune.training.observe.memory_stats import peak_memory_stats
from mtune.training.planning.breakdown import MemoryBreakdown
from mtune.training.memory.techniques.activation_checkpointing.checkpoint import apply_activation_checkpointing
from mtune.training.memory.techniques.activation_offloading.offload import apply_activation_offloading
from mtune.training.placement import Placement

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_cpu_peak_is_the_process_peak_rss():
    before = peak_memory_stats("cpu")["peak_memory_gib"]
    with open("/proc/self/status") as f:
        vm_hwm_kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    assert set(peak_memory_stats("cpu")) == {"peak_memory_gib"}
    assert before == pytest.approx(vm_hwm_kib / 2**20, rel=0.02)  # the kernel's own high-water mark


@pytest.mark.cuda
def test_cuda_peaks_reset_per_interval():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.cuda.reset_peak_memory_stats()
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # 0.25 GiB
    del x
    stats = peak_memory_stats("cuda")
    assert stats["peak_memory_gib"] >= 0.25 and stats["peak_memory_reserved_gib"] >= 0.25
    assert peak_memory_stats("cuda")["peak_memory_gib"] < 0.25


def _mlp_step(breakdown, model, optimizer, batch, d_in, d_out):
    with breakdown.track_step():
        x, y = torch.randn(batch, d_in), torch.randn(batch, d_out)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        del x, y, loss
        optimizer.step()
        optimizer.zero_grad()


def test_breakdown_matches_hand_count(tmp_path):
    torch.manual_seed(0)
    batch, d_in, hidden, d_out = 3, 8, 16, 4
    model = torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, d_out))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    breakdown = MemoryBreakdown(model, optimizer, tmp_path, num_steps=2)
    for _ in range(3):  # the third step is past num_steps: tracked for the metrics, not written
        _mlp_step(breakdown, model, optimizer, batch, d_in, d_out)
    n_params = d_in * hidden + hidden + hidden * d_out + d_out  # 212
    fp32 = 4
    summary = json.loads((tmp_path / "memory_breakdown.json").read_text())
    assert [s["step"] for s in summary["steps"]] == [1, 2]
    second = summary["steps"][1]
    peaks = second["category_peak"]["device"]
    assert peaks["parameters"] == peaks["gradients"] == n_params * fp32 == 848
    # AdamW: exp_avg + exp_avg_sq per element, and a 0-d fp32 `step` tensor per parameter tensor
    assert peaks["optimizer_state"] == 2 * n_params * fp32 + 4 * fp32 == 1712
    # the forward's largest instant is the ReLU: x [3,8], y [3,4], linear 1's output [3,16] (freed right after:
    # ReLU saves its output, not its input) and the ReLU's output [3,16]
    assert peaks["activations"] == (3 * 8 + 3 * 4 + 3 * 16 + 3 * 16) * fp32 == 528
    assert second["device_peak_bytes"] == sum(second[c] for c in peaks)
    assert summary["device_peak_bytes"] == max(s["device_peak_bytes"] for s in summary["steps"])
    assert summary["host_peak_bytes"] == 0 and summary["parameter_count"] == 212
    assert (tmp_path / "memory_breakdown.png").read_bytes()[:8] == PNG_MAGIC
    metrics = breakdown.log_metrics()  # all three steps since nothing was logged
    assert metrics["peak_tensor_gib"] * 2**30 == summary["device_peak_bytes"] and metrics["peak_host_tensor_gib"] == 0
    assert breakdown.log_metrics() == {}


def test_nf4_weights_count_their_packed_bytes():
    nf4 = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    weight = torch.nn.Parameter(nf4.to_nf4(torch.randn(128, 256)), requires_grad=False)
    # 32768 4-bit codes + 512 int8 block scalers + 2 fp32 scaler factors + fp32 mean + 16-entry fp32 code table
    assert tensor_storage_bytes([weight])[0] == 32768 // 2 + 512 + 2 * 4 + 4 + 16 * 4 == 16972
    breakdown = MemoryBreakdown(torch.nn.ParameterList([weight]), [], "unused", write=False)
    assert breakdown.tracker.current()["device"]["parameters"] == 16972


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_an_offloaded_parameter_counts_nothing_on_the_device(fake):
    """weight_offloading empties a frozen weight's storage while its group is away. On a fake tensor a new view
    (``.data`` is one) silently re-grows such a storage, so the tracker must read a parameter without making one:
    through ``.data`` it counted every offloaded weight of a planned model on the device at the first step."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mtune.training.planning.tracker import TensorTracker

    mode = FakeTensorMode() if fake else None
    with mode if fake else contextlib.nullcontext():
        away, here = (torch.nn.Parameter(torch.empty(64, 64), requires_grad=False) for _ in range(2))
    away.untyped_storage().resize_(0)
    tracker = TensorTracker(model=torch.nn.ParameterList([away, here]), fake_mode=mode)
    assert tracker.current()["device"]["parameters"] == here.numel() * 4


def test_disabled_or_other_rank_writes_nothing(tmp_path):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for kwargs in ({"rank": 1}, {"enabled": False}):
        breakdown = MemoryBreakdown(model, optimizer, tmp_path, num_steps=1, **kwargs)
        _mlp_step(breakdown, model, optimizer, 1, 2, 2)
        assert list(tmp_path.iterdir()) == []
    assert breakdown.log_metrics() == {}


# ---------------------------------------------------------------- the three bugs of the old breakdown, on a decoder
def _decoder_steps(batch_size, accumulation=1, steps=2, offload=None, checkpoint=False):
    torch.manual_seed(0)
    model = build_model("llama3_1", "tiny", device="cpu", dtype=torch.float32)
    context = None
    if checkpoint:
        apply_activation_checkpointing(model)
    if offload is not None:
        context = apply_activation_offloading(model, use_streams=False, min_offload_bytes=0, placement=offload)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    breakdown = MemoryBreakdown(model, optimizer, "unused", num_steps=steps, write=False, placement=offload)
    for _ in range(steps):
        micro = [{"tokens": torch.randint(0, 512, (batch_size, 32)), "labels": torch.randint(0, 512, (batch_size, 32))}
                 for _ in range(accumulation)]
        with breakdown.track_step():
            if context is not None:
                with context:
                    train_step(model, micro, CrossEntropyLoss(), optimizer, device=torch.device("cpu"))
            else:
                train_step(model, micro, CrossEntropyLoss(), optimizer, device=torch.device("cpu"))
    return breakdown.records


def test_step_one_has_its_own_activations():
    # The old breakdown wrote step k-1's activations into record k (step 1 showed 0).
    first, second = _decoder_steps(4)
    assert first["category_peak"]["device"]["activations"] > 0
    assert first["category_peak"]["device"]["activations"] == second["category_peak"]["device"]["activations"]


def test_accumulation_counts_one_micro_batch_of_activations():
    # The old breakdown summed the micro-batches (batch 8 x 2 reported 2x batch 8).
    single = _decoder_steps(8)[1]["category_peak"]["device"]["activations"]
    accumulated = _decoder_steps(8, accumulation=2)[1]["category_peak"]["device"]["activations"]
    double = _decoder_steps(16)[1]["category_peak"]["device"]["activations"]
    assert accumulated == pytest.approx(single, rel=0.01)
    assert double == pytest.approx(2 * single, rel=0.05)


def test_offloaded_activations_are_counted_where_they_are():
    # The old breakdown saw 0 activations with offloading on, even on CPU where nothing moved.
    plain = _decoder_steps(8, checkpoint=True)[1]
    same_memory = _decoder_steps(8, checkpoint=True, offload=Placement("cpu"))[1]  # CPU-only: nothing moves
    moved = _decoder_steps(8, checkpoint=True, offload=Placement("cpu", "cpu", distinct=True))[1]
    assert same_memory["category_peak"]["device"]["activations"] == plain["category_peak"]["device"]["activations"] > 0
    # moved: at least each block's saved input (8 x 32 x 256 fp32 = 256 KiB) waits on the host, and the device
    # holds that much less activation memory
    block_input = 8 * 32 * 256 * 4
    device = plain["category_peak"]["device"]["activations"]
    assert moved["category_peak"]["host"]["activations"] >= 2 * block_input
    assert moved["category_peak"]["device"]["activations"] <= device - block_input


def test_plan_check_alone_tracks_only_the_first_steps(tmp_path):
    # Tracking costs a Python call per op: without memory_breakdown only num_steps steps are tracked.
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    window = MemoryBreakdown(model, optimizer, tmp_path, num_steps=2, write=False, track_all_steps=False)
    every = MemoryBreakdown(model, optimizer, tmp_path, num_steps=2, write=False)
    for breakdown in (window, every):
        for _ in range(4):
            with breakdown.track_step():
                model(torch.randn(4, 8)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
            breakdown.log_metrics()
    assert window.tracked_steps == 2 and every.tracked_steps == 4
    with window.track_step():  # after the window: nothing is recorded, so no peaks are logged
        model(torch.randn(4, 8)).sum().backward()
    assert window.log_metrics() == {}


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_dtensor_shape_propagation_is_not_counted(fake):
    """DTensor runs every op once more on fake tensors of its own to infer the output's layout; an AdamW step
    over sharded parameters must count as much as over plain ones (it counted 4x the parameters more)."""
    import contextlib

    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from mtune.training.planning.tracker import TensorTracker

    def step_peak(sharded: bool) -> int:
        mode = FakeTensorMode() if fake else None
        with mode if fake else contextlib.nullcontext(), torch.no_grad():
            params = [torch.nn.Parameter(torch.randn(256, 256)) for _ in range(4)]
            if sharded:
                params = [torch.nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)])) for p in params]
            for p in params:
                p.grad = torch.randn_like(p)
            optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=True)
            tracker = TensorTracker(optimizers=[optimizer], fake_mode=mode)
            for p in params:
                tracker.track(p, "parameters")
                tracker.track(p.grad, "gradients")
            with tracker:
                optimizer.step()
            return tracker.take_interval().peak["device"]

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        plain, sharded = step_peak(False), step_peak(True)
    finally:
        dist.destroy_process_group()
    param_bytes = 4 * 256 * 256 * 4
    assert plain >= 4 * param_bytes  # parameters, gradients and the two AdamW states
    assert sharded == plain

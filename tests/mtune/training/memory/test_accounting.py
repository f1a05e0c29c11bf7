import json

import pytest
import torch

from mtune.training.memory.accounting import MemoryBreakdown, peak_memory_stats, tensor_storage_bytes

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


def test_breakdown_matches_hand_count(tmp_path):
    torch.manual_seed(0)
    batch, d_in, hidden, d_out = 3, 8, 16, 4
    model = torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, d_out))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    breakdown = MemoryBreakdown(model, optimizer, tmp_path, num_steps=2)
    for _ in range(3):  # the third step is past num_steps and records nothing
        x, y = torch.randn(batch, d_in), torch.randn(batch, d_out)
        with breakdown.track_forward():
            loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        breakdown.step()
        optimizer.zero_grad()
    n_params = d_in * hidden + hidden + hidden * d_out + d_out  # 212
    fp32 = 4
    expected = {
        "parameters": n_params * fp32,  # 848
        "buffers": 0,
        "gradients": n_params * fp32,
        # AdamW: exp_avg + exp_avg_sq per element, and a 0-d fp32 `step` tensor per parameter tensor
        "optimizer_state": 2 * n_params * fp32 + 4 * fp32,  # 1712
        # saved for backward: Linear 1 its input x, ReLU its output (= Linear 2's input, one storage),
        # mse_loss the prediction and the target; the weights are parameters and not counted again
        "activations": (batch * d_in + batch * hidden + 2 * batch * d_out) * fp32,  # 384
    }
    summary = json.loads((tmp_path / "memory_breakdown.json").read_text())
    assert [s["step"] for s in summary["steps"]] == [1, 2]
    for record in summary["steps"]:
        assert {k: record[k] for k in expected} == expected
        assert record["total"] == sum(expected.values()) == 3792
    assert summary["peak"]["optimizer_state"] == 1712 and summary["parameter_count"] == 212
    assert (tmp_path / "memory_breakdown.png").read_bytes()[:8] == PNG_MAGIC


def test_nf4_weights_count_their_packed_bytes():
    nf4 = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    weight = torch.nn.Parameter(nf4.to_nf4(torch.randn(128, 256)), requires_grad=False)
    # 32768 4-bit codes + 512 int8 block scalers + 2 fp32 scaler factors + fp32 mean + 16-entry fp32 code table
    assert tensor_storage_bytes([weight])[0] == 32768 // 2 + 512 + 2 * 4 + 4 + 16 * 4 == 16972


def test_disabled_or_other_rank_does_nothing(tmp_path):
    model = torch.nn.Linear(2, 2)
    breakdown = MemoryBreakdown(model, torch.optim.SGD(model.parameters(), lr=0.1), tmp_path, rank=1)
    with breakdown.track_forward():
        model(torch.randn(1, 2)).sum().backward()
    breakdown.step()
    assert breakdown.done and list(tmp_path.iterdir()) == []

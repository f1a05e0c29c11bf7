"""The peak MFU is measured against: the GPU table, the measured and cached CPU figure, the bf16-on-CPU warning."""

import json

import pytest
import torch

from mtune.training.observe import peak_flops as pf


def test_gpu_table_by_name_and_dtype():
    assert pf.gpu_peak_flops("NVIDIA H100 80GB HBM3", "bf16").flops == 989.4e12
    assert pf.gpu_peak_flops("NVIDIA H100 PCIe", "bf16").flops == 756.5e12
    assert pf.gpu_peak_flops("NVIDIA H200", "bf16").flops == 989.4e12
    assert pf.gpu_peak_flops("NVIDIA A100-SXM4-80GB", "fp32").flops == 19.5e12
    assert pf.gpu_peak_flops("NVIDIA A100-SXM4-80GB", "fp32", tf32=True).flops == 156e12
    assert pf.gpu_peak_flops("NVIDIA L40S", "fp16").flops == 362e12  # not the L4's row
    assert pf.gpu_peak_flops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 there
    assert pf.gpu_peak_flops("Some Future GPU", "bf16") is None
    assert "datasheet" in pf.gpu_peak_flops("NVIDIA H100 80GB HBM3", "bf16").source


def test_cpu_peak_is_measured_once_then_cached(tmp_path, monkeypatch):
    cache = tmp_path / "peak.json"
    monkeypatch.setenv("MTUNE_PEAK_FLOPS_CACHE", str(cache))
    calls = []
    real = pf.measure_cpu_matmul_flops
    monkeypatch.setattr(pf, "measure_cpu_matmul_flops",
                        lambda dtype, *a, **k: calls.append(dtype) or real(dtype, 128, timed=2))
    first = pf.peak_flops("cpu", "fp32")
    second = pf.peak_flops("cpu", "fp32")
    assert calls == [torch.float32] and first.flops == second.flops > 0
    assert "measured" in first.source and "cached" in second.source
    (key, entry), = json.loads(cache.read_text()).items()
    assert entry["value"] == first.flops and "float32" in key and f"{torch.get_num_threads()} threads" in key
    monkeypatch.setenv("MTUNE_PEAK_FLOPS", "123e9")
    assert pf.peak_flops("cpu", "fp32") == pf.PeakFlops(123e9, "MTUNE_PEAK_FLOPS")


def test_a_figure_measured_on_a_busy_machine_is_measured_again_when_quieter(tmp_path, monkeypatch):
    cache = tmp_path / "peak.json"
    monkeypatch.setattr(pf.os, "cpu_count", lambda: 2)
    rates = iter([10e9, 30e9, 20e9])
    monkeypatch.setattr(pf, "measure_cpu_matmul_flops", lambda *a, **k: next(rates))
    monkeypatch.setattr(pf.os, "getloadavg", lambda: (8.0, 0, 0))
    assert pf.cpu_peak_flops(torch.float32, cache).flops == 10e9  # busy: measured, cached with its load
    assert pf.cpu_peak_flops(torch.float32, cache).flops == 10e9  # still busy: the cache
    monkeypatch.setattr(pf.os, "getloadavg", lambda: (1.0, 0, 0))
    assert pf.cpu_peak_flops(torch.float32, cache).flops == 30e9  # quieter: measured again
    assert pf.cpu_peak_flops(torch.float32, cache).flops == 30e9  # measured quiet: kept


def test_the_busy_rule_re_measures_below_half_the_load_and_keeps_the_higher_figure(tmp_path, monkeypatch):
    """The rule's amounts on 2 CPUs: an entry measured at load 8 is kept at load 4.0 (not below half) and measured
    again at 3.9; a lower new figure does not replace a higher one; an entry measured quiet (load 1.5 <= 2 CPUs) is
    never measured again, however quiet the machine becomes.

    Mutations checked: ``load < entry["loadavg"]`` (no halving) fails at load 4.0; dropping ``_busy(...)`` from
    the condition fails the quiet entry; keeping the new figure even when lower fails the 25e9 line."""
    cache = tmp_path / "peak.json"
    monkeypatch.setattr(pf.os, "cpu_count", lambda: 2)
    rates = iter([10e9, 25e9, 5e9])
    monkeypatch.setattr(pf, "measure_cpu_matmul_flops", lambda *a, **k: next(rates))
    load = [8.0]
    monkeypatch.setattr(pf.os, "getloadavg", lambda: (load[0], 0, 0))
    assert pf.cpu_peak_flops(torch.float32, cache).flops == 10e9  # measured at load 8
    load[0] = 4.0
    assert pf.cpu_peak_flops(torch.float32, cache).flops == 10e9  # exactly half: the cache
    load[0] = 3.9
    assert pf.cpu_peak_flops(torch.float32, cache).flops == 25e9  # below half: measured again, higher kept
    cache.write_text(json.dumps({next(iter(json.loads(cache.read_text()))): {"value": 30e9, "loadavg": 1.5}}))
    load[0] = 0.1
    assert pf.cpu_peak_flops(torch.float32, cache).flops == 30e9  # measured quiet: never again
    busy = {k: {"value": 30e9, "loadavg": 9.0} for k in json.loads(cache.read_text())}
    cache.write_text(json.dumps(busy))
    assert pf.cpu_peak_flops(torch.float32, cache).flops == 30e9  # measured again (5e9): the higher figure kept
    assert next(rates, None) is None  # every rate was used: three measurements


def test_measured_rate_is_flops_over_best_time(monkeypatch):
    ticks = iter([0.0, 0.5, 1.0, 1.25, 2.0, 2.4])  # three timed calls: 0.5 s, 0.25 s, 0.4 s
    monkeypatch.setattr(pf.time, "perf_counter", lambda: next(ticks))
    assert pf.measure_cpu_matmul_flops(torch.float32, 64, warmup=0, timed=3, budget_s=10) == 2 * 64**3 / 0.25


def test_native_bf16_flags():
    assert pf.cpu_has_native_bf16({"avx2", "avx512f", "avx512_bf16"})
    assert pf.cpu_has_native_bf16({"amx_bf16", "amx_tile"})
    assert pf.cpu_has_native_bf16({"fp", "asimd", "bf16"})  # Arm
    assert not pf.cpu_has_native_bf16({"avx2", "avx512f", "avx512_vnni"})


def test_bf16_warning_only_for_bf16_on_a_cpu_without_it(tmp_path, monkeypatch):
    cache = tmp_path / "peak.json"
    monkeypatch.setattr(pf, "cpu_has_native_bf16", lambda: False)
    rates = {torch.bfloat16: 20e9, torch.float32: 60e9}
    monkeypatch.setattr(pf, "measure_cpu_matmul_flops", lambda dtype, *a, **k: rates[dtype])
    text = pf.cpu_bf16_warning("cpu", "bf16", cache)
    assert "20.0 GFLOP/s in bf16 against 60.0 in fp32" in text and "3x slower" in text and "dtype=fp32" in text
    assert pf.cpu_bf16_warning("cpu", "fp32", cache) is None
    assert pf.cpu_bf16_warning("meta", "bf16", cache) is None
    monkeypatch.setattr(pf, "cpu_has_native_bf16", lambda: True)
    assert pf.cpu_bf16_warning("cpu", "bf16", cache) is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_this_gpu_has_a_peak_in_the_table():
    peak = pf.peak_flops("cuda", "bf16")
    assert peak is not None, f"{torch.cuda.get_device_name()} is not in GPU_PEAK_TFLOPS"
    assert peak.flops > 1e13 and "datasheet" in peak.source

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


def test_gpu_table_rows_that_share_a_name_and_tf32_only_for_fp32():
    """The NVL parts share their SXM sibling's name up to "NVL" and are slower (835.5 against 989.4 bf16
    TFLOP/s): the NVL row must match first. TF32 replaces only fp32's figure: a bf16 run with
    ``allow_tf32`` on keeps bf16's peak (tf32's is half, which would double its MFU). The printed peak is in
    TFLOP/s.

    Mutations seen failing: the H200 NVL row after the SXM row; ``key = "tf32" if tf32`` for any dtype; the ``T``
    unit's scale at 1e13 (989.4e12 printed as ``98.94 T``). Bug this found (fixed): the GH200 row after H200 SXM's,
    whose "H200" a GH200's name contains (the same figures, under H200 SXM's name)."""
    assert pf.gpu_peak_flops("NVIDIA H200 NVL", "bf16").flops == 835.5e12
    assert pf.gpu_peak_flops("NVIDIA H100 NVL", "fp16").flops == 835.5e12
    assert pf.gpu_peak_flops("NVIDIA GH200 480GB", "bf16").source.startswith("NVIDIA GH200 ")  # not H200 SXM's row
    assert pf.gpu_peak_flops("NVIDIA H100 80GB HBM3", "bf16", tf32=True).flops == 989.4e12
    assert pf.gpu_peak_flops("NVIDIA H100 80GB HBM3", "fp16", tf32=True).flops == 989.4e12
    assert pf.gpu_peak_flops("NVIDIA H100 80GB HBM3", "fp32", tf32=True).flops == 494.7e12
    assert str(pf.gpu_peak_flops("NVIDIA H100 80GB HBM3", "bf16")) == "989.4 TFLOP/s (NVIDIA H100 SXM bf16 dense, " \
        "datasheet)"
    assert str(pf.PeakFlops(51.2e9, "measured")) == "51.2 GFLOP/s (measured)"


def test_each_dtype_is_measured_in_its_own_dtype(tmp_path, monkeypatch):
    """``peak_flops("cpu", name)`` measures (and caches) in the torch dtype of that name. Mutation seen failing:
    ``fp16`` measured in bfloat16."""
    monkeypatch.setenv("MTUNE_PEAK_FLOPS_CACHE", str(tmp_path / "peak.json"))
    monkeypatch.delenv("MTUNE_PEAK_FLOPS", raising=False)
    rates = {torch.float32: 3e9, torch.bfloat16: 2e9, torch.float16: 1e9}
    monkeypatch.setattr(pf, "measure_cpu_matmul_flops", lambda dtype, *a, **k: rates[dtype])
    assert [pf.peak_flops("cpu", name).flops for name in ("fp32", "bf16", "fp16")] == [3e9, 2e9, 1e9]


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


def test_a_load_equal_to_the_cpu_count_is_not_busy(tmp_path, monkeypatch):
    """Busy is a 1-minute load *above* the CPU count: a figure measured at load 2.0 on 2 CPUs is a quiet one, kept
    however quiet the machine becomes. Mutation seen failing: ``load >= cpu_count`` (measured again at 0.5)."""
    cache = tmp_path / "peak.json"
    monkeypatch.setattr(pf.os, "cpu_count", lambda: 2)
    rates = iter([10e9, 30e9])
    monkeypatch.setattr(pf, "measure_cpu_matmul_flops", lambda *a, **k: next(rates))
    load = [2.0]
    monkeypatch.setattr(pf.os, "getloadavg", lambda: (load[0], 0, 0))
    assert pf.cpu_peak_flops(torch.float32, cache).flops == 10e9
    load[0] = 0.5
    assert pf.cpu_peak_flops(torch.float32, cache).flops == 10e9


def test_measured_rate_is_flops_over_best_time(monkeypatch):
    ticks = iter([0.0, 0.5, 1.0, 1.25, 2.0, 2.4])  # three timed calls: 0.5 s, 0.25 s, 0.4 s
    monkeypatch.setattr(pf.time, "perf_counter", lambda: next(ticks))
    assert pf.measure_cpu_matmul_flops(torch.float32, 64, warmup=0, timed=3, budget_s=10) == 2 * 64**3 / 0.25


def test_step_mix_rate_is_all_layouts_flops_over_the_sum_of_their_best_times(monkeypatch):
    """Three layouts of 2 * 64³ FLOPs each, timed (fake clock) at best 0.5, 0.25 and 0.125 s: 3 * 2 * 64³ / 0.875
    s. The time budget is over all timed calls of a layout so far: with budget 0.75 s the first layout stops after
    its second call (0.5 + 0.5 s), never timing a third; warm-up calls are not timed but run (counted on F.linear,
    the ``x@W.T`` layout).

    Mutations seen failing: the FLOPs not multiplied by the layouts (a third of the rate); the budget checked per
    call (a third x@W.T call timed); the warm-up calls skipped (2 F.linear calls, not 4)."""
    ticks = iter([0.0, 0.5, 1.0, 1.5,                # x@W.T: 0.5, 0.5 (1.0 s > budget: stop)
                  2.0, 2.25, 3.0, 3.25, 4.0, 4.5,    # g@W: 0.25, 0.25, 0.5
                  5.0, 5.25, 6.0, 6.125, 7.0, 7.5])  # g.T@x: 0.25, 0.125, 0.5
    monkeypatch.setattr(pf.time, "perf_counter", lambda: next(ticks))
    linear_calls = []
    real_linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a: linear_calls.append(1) or real_linear(*a))
    rate = pf.measure_cpu_matmul_flops(torch.float32, 64, pf.STEP_LAYOUTS, warmup=2, timed=3, budget_s=0.75)
    assert rate == 3 * 2 * 64**3 / (0.5 + 0.25 + 0.125)
    assert len(linear_calls) == 2 + 2  # two warm-up calls, two timed (the budget ended the third)
    assert next(ticks, None) is None  # every timed call read the clock twice, no more


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

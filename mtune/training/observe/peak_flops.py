"""The device's peak FLOP/s, the denominator of MFU and HFU; and whether a CPU computes bf16 natively.

- **GPUs**: dense (no sparsity) tensor-core peaks from the vendors' datasheets, by the dtype the matmuls run in
  (``fp32`` uses the FP32 figure, or TF32's when ``torch.backends.cuda.matmul.allow_tf32`` is on; ``fp16`` training
  runs its matmuls in fp16 under autocast). Sources are in ``docs/benchmarks.md``.
- **CPUs**: no table can know a CPU's threads, clocks and vector units, so the peak is measured by one fixed
  procedure: ``F.linear`` of two 2048 x 2048 matrices (``2 * 2048**3`` FLOPs, nn.Linear's layout) in the run's
  dtype with torch's current thread count, one warm-up call, then the best of five timed calls (fewer once a second
  of them has passed: bf16 without native support takes seconds per call). The figure is cached per CPU model,
  torch version, dtype and thread count in ``$MTUNE_PEAK_FLOPS_CACHE`` (default ``~/.cache/mtune/peak_flops.json``)
  with the load average it was measured under; one taken on a busy machine is measured again once the load has
  halved, keeping the higher figure.
- ``MTUNE_PEAK_FLOPS`` (FLOP/s, e.g. ``989e12``) overrides both.

The peak is what a dense matmul of that dtype can reach, so a run's MFU is its distance from the best this device
does on the work that dominates training. Attention and thin projections run below that rate.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["PeakFlops", "GPU_PEAK_TFLOPS", "peak_flops", "gpu_peak_flops", "measure_cpu_matmul_flops",
           "cpu_peak_flops", "cpu_step_matmul_flops", "cpu_model_name", "cpu_has_native_bf16", "cpu_bf16_warning",
           "peak_cache_path", "run_peak_flops"]

log = logging.getLogger(__name__)

MATMUL_SIZE = 2048
WARMUP_CALLS = 1
TIMED_CALLS = 5

# name, substrings that all must appear in torch.cuda.get_device_name() (checked in order: a row before those whose
# substrings its name contains, e.g. GH200 before H200), dense TFLOP/s by dtype.
GPU_PEAK_TFLOPS: list[tuple[str, tuple[str, ...], dict[str, float]]] = [
    ("NVIDIA B200", ("B200",), {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 80.0}),
    ("NVIDIA GH200", ("GH200",), {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("NVIDIA H200 NVL", ("H200", "NVL"), {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    ("NVIDIA H200 SXM", ("H200",), {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("NVIDIA H100 NVL", ("H100", "NVL"), {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    ("NVIDIA H100 PCIe", ("H100", "PCIe"), {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    ("NVIDIA H100 SXM", ("H100",), {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("NVIDIA A100", ("A100",), {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("NVIDIA L40S", ("L40S",), {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6}),
    ("NVIDIA L4", ("L4",), {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("NVIDIA A10", ("A10",), {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    ("NVIDIA GeForce RTX 4090", ("RTX 4090",), {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    ("NVIDIA GeForce RTX 3090", ("RTX 3090",), {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6}),
    ("NVIDIA V100", ("V100",), {"fp16": 125.0, "fp32": 15.7}),
    ("NVIDIA T4", ("T4",), {"fp16": 65.0, "fp32": 8.1}),
    ("AMD Instinct MI300X", ("MI300X",), {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
]
"""Dense peaks in TFLOP/s (datasheet figures "with sparsity" halved). ``tf32`` applies to fp32 matmuls when TF32
is allowed."""


@dataclass(frozen=True)
class PeakFlops:
    """A peak in FLOP/s and where it comes from (printed beside MFU)."""

    flops: float
    source: str

    def __str__(self) -> str:
        return f"{_human(self.flops)}FLOP/s ({self.source})"


def _human(flops: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if flops >= scale:
            return f"{flops / scale:.4g} {unit}"
    return f"{flops:.4g} "


def peak_cache_path() -> Path:
    """``$MTUNE_PEAK_FLOPS_CACHE``, else ``~/.cache/mtune/peak_flops.json``."""
    path = os.environ.get("MTUNE_PEAK_FLOPS_CACHE")
    return Path(path).expanduser() if path else Path.home() / ".cache" / "mtune" / "peak_flops.json"


def gpu_peak_flops(device_name: str, dtype_name: str, tf32: bool = False) -> PeakFlops | None:
    """The table's dense peak for a GPU named ``device_name`` (as ``torch.cuda.get_device_name`` says it) computing
    in ``dtype_name`` (``fp32``, ``bf16``, ``fp16``), or None when it is not in the table."""
    key = "tf32" if dtype_name == "fp32" and tf32 else dtype_name
    for name, parts, peaks in GPU_PEAK_TFLOPS:
        if all(p in device_name for p in parts):
            if key not in peaks:
                return None
            return PeakFlops(peaks[key] * 1e12, f"{name} {key} dense, datasheet")
    return None


def cpu_model_name() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_has_native_bf16(flags: set[str] | None = None) -> bool:
    """Whether the CPU has bf16 matmul instructions: x86 AVX512-BF16 or AMX-BF16 (``avx512_bf16``, ``amx_bf16`` in
    /proc/cpuinfo), Arm's ``bf16`` extension; without /proc/cpuinfo, torch's CPU capability naming AMX or BF16."""
    flags = _cpu_flags() if flags is None else flags
    if flags:
        return bool({"avx512_bf16", "amx_bf16", "bf16"} & flags)
    capability = torch.backends.cpu.get_cpu_capability().upper()
    return "AMX" in capability or "BF16" in capability


def measure_cpu_matmul_flops(dtype: torch.dtype, size: int = MATMUL_SIZE, layouts: tuple[str, ...] = ("x@W.T",),
                             warmup: int = WARMUP_CALLS, timed: int = TIMED_CALLS, budget_s: float = 1.0) -> float:
    """FLOP/s of ``size``-square matmuls in ``dtype`` with torch's thread count: for each layout (``"x@W.T"``, an
    nn.Linear forward; ``"g@W"``, its input gradient; ``"g.T@x"``, its weight gradient) the best of ``timed`` calls
    after ``warmup``, fewer once ``budget_s`` of timed calls have passed (at least one); all layouts' FLOPs over the
    sum of their best times."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g).to(dtype)
    b = torch.randn(size, size, generator=g).to(dtype)
    calls = {"x@W.T": lambda: torch.nn.functional.linear(a, b), "g@W": lambda: a @ b, "g.T@x": lambda: a.T @ b}
    total = 0.0
    for layout in layouts:
        call = calls[layout]
        for _ in range(warmup):
            call()
        best, spent = float("inf"), 0.0
        for _ in range(timed):
            start = time.perf_counter()
            call()
            took = time.perf_counter() - start
            best, spent = min(best, took), spent + took
            if spent > budget_s:
                break
        total += best
    return 2.0 * size**3 * len(layouts) / total


def _busy(load: float) -> bool:
    return load > (os.cpu_count() or 1)


def _cached(key: str, measure, cache: Path | None) -> tuple[float, bool]:
    """``(value, came from the cache)`` for ``key`` in the peak cache, measuring and storing it when absent. A value
    measured while the machine was busy (1-minute load above the CPU count) is measured again when the load has
    halved since, and the higher figure kept."""
    cache = cache or peak_cache_path()
    try:
        table = json.loads(cache.read_text())
    except (OSError, ValueError):
        table = {}
    load = os.getloadavg()[0]
    entry = table.get(key)
    if entry is not None and not (_busy(entry["loadavg"]) and load < entry["loadavg"] / 2):
        return float(entry["value"]), True
    value = float(measure())
    if entry is not None and entry["value"] > value:
        value, load = entry["value"], entry["loadavg"]
    if _busy(load):
        log.info("measured the CPU's matmul peak while the machine is busy (load %.1f on %d CPUs): mfu reads high "
                 "until it is measured again on a quieter machine", load, os.cpu_count() or 1)
    table[key] = {"value": value, "loadavg": load}
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        tmp.replace(cache)
    except OSError as err:
        log.debug("could not cache the CPU peak in %s: %s", cache, err)
    return value, False


def _key(what: str, dtype: torch.dtype) -> str:
    return (f"{cpu_model_name()}|torch {torch.__version__}|{str(dtype).removeprefix('torch.')}|"
            f"{torch.get_num_threads()} threads|{what}")


def cpu_peak_flops(dtype: torch.dtype, cache: Path | None = None) -> PeakFlops:
    """The CPU's measured matmul peak in ``dtype`` (see the module docstring), from the cache when there."""
    flops, cached = _cached(_key(f"F.linear {MATMUL_SIZE}", dtype), lambda: measure_cpu_matmul_flops(dtype), cache)
    source = f"measured: {MATMUL_SIZE}² matmul, {torch.get_num_threads()} threads, best of {TIMED_CALLS}"
    return PeakFlops(flops, source + (", cached" if cached else ""))


STEP_LAYOUTS = ("x@W.T", "g@W", "g.T@x")
STEP_MIX_SIZE = 512


def cpu_step_matmul_flops(dtype: torch.dtype, cache: Path | None = None) -> float:
    """FLOP/s of a training step's three matmul layouts (forward, input and weight gradient) at 512², measured
    and cached like :func:`cpu_peak_flops`: the bf16 warning's ratio, since without native bf16 the gradient
    layouts run far slower than the forward's."""
    return _cached(_key(f"step mix {STEP_MIX_SIZE}", dtype),
                   lambda: measure_cpu_matmul_flops(dtype, STEP_MIX_SIZE, STEP_LAYOUTS, timed=3), cache)[0]


def peak_flops(device: torch.device | str, dtype_name: str) -> PeakFlops | None:
    """The peak MFU is measured against on ``device`` computing in ``dtype_name`` (``fp32``, ``bf16``, ``fp16``):
    ``MTUNE_PEAK_FLOPS`` when set, a GPU's table entry, a CPU's measured figure; None when unknown."""
    override = os.environ.get("MTUNE_PEAK_FLOPS")
    if override:
        return PeakFlops(float(override), "MTUNE_PEAK_FLOPS")
    device = torch.device(device)
    if device.type == "cpu":
        return cpu_peak_flops({"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name])
    if device.type == "cuda":
        tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
        return gpu_peak_flops(torch.cuda.get_device_name(device), dtype_name, tf32=tf32)
    return None


def cpu_bf16_warning(device: torch.device | str, dtype_name: str, cache: Path | None = None) -> str | None:
    """The warning to show when ``dtype=bf16`` runs on a CPU without native bf16 (None otherwise), with the measured
    slowdown of a training step's matmuls (:func:`cpu_step_matmul_flops`) against fp32."""
    if torch.device(device).type != "cpu" or dtype_name != "bf16" or cpu_has_native_bf16():
        return None
    bf16, fp32 = cpu_step_matmul_flops(torch.bfloat16, cache), cpu_step_matmul_flops(torch.float32, cache)
    head = f"dtype=bf16 on {cpu_model_name()}, a CPU without native bf16 (no AVX512-BF16 or AMX): "
    measured = (f"a training step's matmuls run at {bf16 / 1e9:.1f} GFLOP/s in bf16 against {fp32 / 1e9:.1f} in "
                f"fp32 here (measured, {STEP_MIX_SIZE}², forward and both gradients)")
    if bf16 >= fp32:
        return head + "bf16 is emulated; " + measured + "."
    return (head + measured + f", so this run computes about {fp32 / bf16:.0f}x slower than with dtype=fp32. Set "
            "dtype=fp32 unless the memory that bf16 halves (weights, gradients, activations) is what you lack.")


def run_peak_flops(device: torch.device | str, dtype_name: str, *, announce: bool = True) -> PeakFlops | None:
    """A run's :func:`peak_flops` (None when unknown: then no mfu is logged). With ``announce`` (rank 0) it says
    which peak mfu/hfu are measured against, or how to give one, and warns first when bf16 runs on a CPU that
    emulates it (:func:`cpu_bf16_warning`)."""
    warning = cpu_bf16_warning(device, dtype_name)
    if warning and announce:
        log.warning(warning)
    peak = peak_flops(device, dtype_name)
    if announce:
        if peak is None:
            log.info("mfu/hfu: no peak FLOP/s known for %s in %s: set MTUNE_PEAK_FLOPS (FLOP/s) to log them",
                     device, dtype_name)
        else:
            log.info("mfu/hfu against %s in %s: %s", device, dtype_name, peak)
    return peak

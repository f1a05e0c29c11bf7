"""mtune's filter of its dependencies' import-time notes (`mtune/__init__.py`): torchao's CUDA-only kernels on a CPU
build, torch's note on torchao's Enum registrations, and bitsandbytes' optional CPU 4-bit kernel package (`mtune
plan --fit` printed the last first thing) say nothing a user can act on."""

import importlib
import logging


def _shown(logger: str, message: str) -> bool:
    """Whether a warning ``message`` logged to ``logger`` gets past mtune's filters."""
    importlib.import_module("mtune")  # installs the filters

    record = logging.LogRecord(logger, logging.WARNING, __file__, 1, message, None, None)
    return logging.getLogger(logger).filter(record)


def test_bitsandbytes_cpu_kernel_note_is_dropped_and_its_other_warnings_kept():
    """The note as bitsandbytes 0.50 logs it at import (`bitsandbytes/backends/cpu/ops.py`)."""
    logger = "bitsandbytes.backends.cpu.ops"
    assert not _shown(logger, "Failed to load CPU gemm_4bit_forward from kernels-community: No module named "
                              "'kernels'. Please make sure you already `pip install kernels` and the kernels >= 0.11.1")
    assert _shown(logger, "some other warning")

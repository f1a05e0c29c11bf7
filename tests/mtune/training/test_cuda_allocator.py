"""On CUDA a run asks the caching allocator for expandable segments before it allocates, unless the user's
PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF chose settings; CUDA itself is stood in for (no GPU here)."""

import logging

import pytest
import torch
from omegaconf import OmegaConf

from mtune.training import context

GIB = 2**30


@pytest.fixture
def cuda_calls(monkeypatch):
    """The CUDA calls a run's setup makes, recorded in order."""
    calls = []
    for name in context.ALLOCATOR_SETTINGS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", str(device))))
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", lambda text: calls.append(("settings", text)),
                        raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": 80 * GIB}))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append(("fraction", f)))
    return calls


def test_expandable_segments_before_the_limit_where_the_user_chose_nothing(cuda_calls, caplog):
    with caplog.at_level(logging.INFO, logger="mtune.training.context"):
        context.prepare_cuda(torch.device("cuda", 1), "20GiB")
    assert cuda_calls == [("set_device", "cuda:1"), ("settings", "expandable_segments:True"), ("fraction", 0.25)]
    assert "CUDA allocator: expandable_segments:True (mtune's default" in caplog.text


@pytest.mark.parametrize("variable", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_the_users_settings_stand(cuda_calls, monkeypatch, variable):
    monkeypatch.setenv(variable, "expandable_segments:False,max_split_size_mb:512")
    line = context.configure_cuda_allocator()
    assert cuda_calls == []
    assert line.startswith(f"CUDA allocator: {variable}=expandable_segments:False,max_split_size_mb:512 (yours")


def test_a_torch_that_cannot_set_them_is_said(cuda_calls, monkeypatch):
    monkeypatch.delattr(torch.cuda.memory, "_set_allocator_settings")
    line = context.configure_cuda_allocator()
    assert cuda_calls == [] and "cannot set expandable_segments:True" in line
    assert "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in line


def test_setup_run_on_cuda_prepares_the_device_through_prepare_cuda(cuda_calls, monkeypatch, tmp_path):
    """``setup_run`` on a CUDA device goes through ``prepare_cuda`` (mutation seen failing: setup_run calling
    set_device and the limit itself, without the allocator settings)."""
    monkeypatch.setattr(context, "resolve_device", lambda name, local_rank: torch.device("cuda", 0))
    monkeypatch.setattr(context, "resolve_dtype", lambda name, device: torch.float32)
    cfg = OmegaConf.create({"device": "cuda", "dtype": "fp32", "seed": 0, "output_dir": str(tmp_path / "run"),
                            "resume_from_checkpoint": False, "overwrite_output_dir": False,
                            "device_memory_limit": "40GiB"})
    try:
        run = context.setup_run(cfg)
    finally:
        from mtune.training.output_lock import release_output_locks

        release_output_locks()
    assert run.device == torch.device("cuda", 0)
    assert cuda_calls == [("set_device", "cuda:0"), ("settings", "expandable_segments:True"), ("fraction", 0.5)]

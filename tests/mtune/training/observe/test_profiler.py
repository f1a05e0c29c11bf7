import json

import pytest
import torch

from mtune.training.observe.profiler import NullProfiler, build_profiler


def test_disabled_is_a_no_op(tmp_path):
    for node in (None, {"enabled": False}):
        profiler = build_profiler(node, output_dir=tmp_path)
        assert isinstance(profiler, NullProfiler)
        with profiler:
            profiler.step()
    assert list(tmp_path.iterdir()) == []


def test_traces_the_active_steps(tmp_path):
    node = {"_component_": "mtune.training.observe.profiler.setup_torch_profiler", "enabled": True, "wait_steps": 1,
            "warmup_steps": 1, "active_steps": 2, "num_cycles": 1}
    x = torch.randn(32, 32)
    with build_profiler(node, output_dir=tmp_path) as profiler:
        for step in range(6):
            with torch.profiler.record_function(f"mtune_step_{step}"):
                x = torch.tanh(x @ x)
            profiler.step()
    files = sorted(p.name for p in (tmp_path / "profiler").iterdir())
    assert files == ["rank0_step4.pt.trace.json", "rank0_step4.txt"]
    trace = json.loads((tmp_path / "profiler" / "rank0_step4.pt.trace.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    # steps 0 (wait) and 1 (warmup) are not in the trace; steps 2 and 3 are
    assert {"mtune_step_2", "mtune_step_3"} <= names and not {"mtune_step_0", "mtune_step_1"} & names
    assert "aten::mm" in (tmp_path / "profiler" / "rank0_step4.txt").read_text()


def test_bad_settings_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="profiler.active_steps must be >= 1, got 0"):
        build_profiler({"enabled": True, "active_steps": 0}, output_dir=tmp_path)
    with pytest.raises(ValueError, match="profiler._component_ must be"):
        build_profiler({"_component_": "x.y"}, output_dir=tmp_path)

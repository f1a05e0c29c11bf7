"""TrainingMonitor in-process: the last step always reaches metrics.jsonl, no plot without a loss."""

import json
import warnings

import pytest
import torch

from mtune.training.loop import StepResult
from mtune.training.observe.monitor import TrainingMonitor

KEYS = {"step", "epoch", "loss", "lr", "trained_tokens", "tokens_per_second", "tokens_per_second_per_device",
        "peak_memory_gib", "grad_norm"}


def _monitor(tmp_path, total_steps, log_every_n_steps):
    return TrainingMonitor(output_dir=tmp_path, device=torch.device("cpu"), total_steps=total_steps,
                           log_every_n_steps=log_every_n_steps)


def _steps(monitor, steps):
    for step in steps:
        result = StepResult(loss=3.0 / step, trained_tokens=10, num_tokens=16, grad_norm=1.5, stepped=True)
        monitor.step(step=step, epoch=0, result=result, lr=1e-3)


def _rows(tmp_path):
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_run_shorter_than_log_interval_logs_its_last_step(tmp_path):
    monitor = _monitor(tmp_path, total_steps=3, log_every_n_steps=10)
    _steps(monitor, [1, 2, 3])
    rows = _rows(tmp_path)  # written at step 3, before close
    assert [r["step"] for r in rows] == [3]
    assert set(rows[0]) == KEYS and rows[0]["loss"] == 1.0 and rows[0]["tokens_per_second"] > 0
    monitor.close()
    assert [r["step"] for r in _rows(tmp_path)] == [3]  # not written twice
    assert (tmp_path / "loss_curve.png").is_file()


def test_run_stopped_between_log_steps_gets_its_last_step_at_close(tmp_path):
    monitor = _monitor(tmp_path, total_steps=10, log_every_n_steps=4)
    _steps(monitor, [1, 2, 3, 4, 5, 6])  # a signal stops the run after step 6
    assert [r["step"] for r in _rows(tmp_path)] == [4]
    monitor.close()
    monitor.close()
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [4, 6]
    assert set(rows[1]) == KEYS and rows[1]["loss"] == 0.5 and rows[1]["tokens_per_second"] > 0


def test_no_steps_no_plot_and_no_warning(tmp_path):
    monitor = _monitor(tmp_path, total_steps=3, log_every_n_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monitor.close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    assert not (tmp_path / "loss_curve.png").exists()


def test_mfu_and_hfu_from_step_flops_and_the_peak(tmp_path):
    from mtune.training.observe.peak_flops import PeakFlops

    peak = PeakFlops(1e9, "test")
    monitor = TrainingMonitor(output_dir=tmp_path, device=torch.device("cpu"), total_steps=3, peak=peak)
    for step in (1, 2, 3):
        result = StepResult(loss=1.0, trained_tokens=10, num_tokens=16, grad_norm=None, stepped=True)
        monitor.step(step=step, epoch=0, result=result, lr=1e-3, flops=(16 * 100.0, 16 * 150.0))
    monitor.close()
    for row in _rows(tmp_path):
        assert row["mfu"] == pytest.approx(100.0 * row["tokens_per_second_per_device"] / 1e9)
        assert row["hfu"] == pytest.approx(1.5 * row["mfu"])
    summary = monitor.summary()
    assert summary["steps"] == 2 and summary["mfu"] == pytest.approx(100.0 * summary["tokens_per_second"] / 1e9)
    assert "mfu" in monitor.summary_line() and "(test)" in monitor.summary_line()


def test_the_first_steps_time_is_stated_from_its_start_to_its_end(tmp_path):
    # a clock the test moves: the first step runs from 10.0 to 12.5; later steps' starts do not count
    now = [0.0]
    monitor = _monitor(tmp_path, total_steps=3, log_every_n_steps=1)
    monitor.timer._clock = lambda: now[0]
    for step, (start, end) in enumerate([(10.0, 12.5), (13.0, 13.25), (13.5, 13.75)], start=1):
        now[0] = start
        monitor.step_started()
        now[0] = end
        result = StepResult(loss=1.0, trained_tokens=10, num_tokens=16, grad_norm=None, stepped=True)
        monitor.step(step=step, epoch=0, result=result, lr=1e-3)
    monitor.close()
    assert monitor.summary()["first_step_s"] == 2.5
    assert "(the first excluded: it took 2.5 s): " in monitor.summary_line()
    unmarked = _monitor(tmp_path / "unmarked", total_steps=2, log_every_n_steps=1)
    _steps(unmarked, [1, 2])
    assert "first_step_s" not in unmarked.summary() and "(the first excluded): " in unmarked.summary_line()

import io
import json
import math
import time

import pytest

from mtune.training.observe.metric_logging import (
    JsonlLogger,
    MetricLogger,
    MultiLogger,
    NullLogger,
    build_metric_logger,
)
from mtune.training.observe.step_timer import StepTimer
from mtune.training.observe.progress import TrainingProgress, format_metrics

ROWS = [
    {"epoch": 0, "loss": 2.5, "lr": 1e-4, "grad_norm": 1.25, "tokens_per_second": 1000.0,
     "tokens_per_second_per_device": 500.0, "trained_tokens": 96, "peak_memory_gib": 0.75},
    {"epoch": 0, "loss": 2.0, "lr": 2e-4, "tokens_per_second": 1100.0, "tokens_per_second_per_device": 550.0,
     "trained_tokens": 80, "peak_memory_gib": 0.8, "val_loss": 2.25},
]


def _log_rows(logger):
    # "step" among the metrics too, as TrainingMonitor passes it: a backend must not log it as a scalar (the
    # TensorBoard test's "step" tag fails without its filter, mutation seen failing)
    for i, row in enumerate(ROWS, start=1):
        logger.log_dict({"step": i, **row}, step=i)


def test_jsonl_one_object_per_step_flushed_and_appended(tmp_path):
    logger = build_metric_logger(None, output_dir=tmp_path, rank=0, world_size=2)
    assert isinstance(logger, JsonlLogger) and isinstance(logger, MetricLogger)
    _log_rows(logger)
    # flushed: readable before close
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"step": i, **row} for i, row in enumerate(ROWS, start=1)]
    assert list(json.loads(lines[0]))[0] == "step"
    logger.close()
    # a resumed run appends; NaN is written as null so the file stays strict JSON
    again = JsonlLogger(tmp_path)
    again.log_dict({"loss": math.nan, "lr": 0.5}, step=3)
    again.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[2]) == {"step": 3, "loss": None, "lr": 0.5}


def test_tensor_values_become_numbers(tmp_path):
    torch = pytest.importorskip("torch")
    logger = JsonlLogger(tmp_path)
    logger.log_dict({"loss": torch.tensor(1.5), "trained_tokens": torch.tensor(7)}, step=1)
    logger.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "loss": 1.5, "trained_tokens": 7}


def test_jsonl_keeps_ints_and_writes_every_non_finite_float_as_null(tmp_path):
    """A line read back from metrics.jsonl: counts stay JSON integers (``96``, not ``96.0``), and +inf / -inf
    (an fp16 overflow's grad_norm) are null like NaN, so the file stays strict JSON.

    Mutations seen failing: ints written as floats (``float(value)``: json.loads' 96.0 == 96, so the type is
    checked); ``not math.isnan`` for ``math.isfinite`` (json.dumps(allow_nan=False) raises on inf)."""
    logger = JsonlLogger(tmp_path)
    logger.log_dict({"trained_tokens": 96, "grad_norm": math.inf, "loss": -math.inf, "lr": 0.5}, step=2)
    logger.close()
    line = (tmp_path / "metrics.jsonl").read_text()
    row = json.loads(line)
    assert row == {"step": 2, "trained_tokens": 96, "grad_norm": None, "loss": None, "lr": 0.5}
    assert type(row["trained_tokens"]) is int and '"trained_tokens": 96,' in line


def test_naming_jsonl_as_the_backend_adds_no_second_file_writer(tmp_path):
    """``_component_: ...JsonlLogger`` adds nothing to the JSONL every run writes: one line per step, not two.
    Mutation seen failing: only NullLogger excluded (a second JsonlLogger appending the same rows)."""
    logger = build_metric_logger({"_component_": "mtune.training.observe.metric_logging.JsonlLogger"},
                                 output_dir=tmp_path)
    assert isinstance(logger, JsonlLogger)
    _log_rows(logger)
    logger.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == len(ROWS)


def test_non_zero_rank_writes_nothing(tmp_path):
    logger = build_metric_logger({"_component_": "mtune.training.observe.metric_logging.TensorBoardLogger"},
                                 output_dir=tmp_path, rank=1, world_size=2)
    assert isinstance(logger, NullLogger)
    _log_rows(logger)
    logger.close()
    assert list(tmp_path.iterdir()) == []


def test_bad_component_is_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match="metric_logger._component_: cannot import 'mtune.nope.Logger'"):
        build_metric_logger({"_component_": "mtune.nope.Logger"}, output_dir=tmp_path)


def test_tensorboard_events_readable(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    logger = build_metric_logger({"_component_": "mtune.training.observe.metric_logging.TensorBoardLogger"}, output_dir=tmp_path)
    assert isinstance(logger, MultiLogger)
    _log_rows(logger)
    logger.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2  # JSONL written as well
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 2.5), (2, 2.0)]
    assert [(e.step, e.value) for e in acc.Scalars("val_loss")] == [(2, 2.25)]
    assert acc.Scalars("lr")[1].value == pytest.approx(2e-4)
    assert "epoch" in acc.Tags()["scalars"] and "step" not in acc.Tags()["scalars"]


def test_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = build_metric_logger({"_component_": "mtune.training.observe.metric_logging.WandBLogger", "project": "mtune-test"},
                                 output_dir=tmp_path)
    wandb_logger = logger.loggers[1]
    _log_rows(logger)
    # wandb commits a step's row when the next step arrives: step 1 is in the run summary now
    assert wandb_logger.run.summary["loss"] == 2.5 and wandb_logger.run.summary["trained_tokens"] == 96
    logger.close()
    run_files = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1
    # wandb-core (a separate process) writes the run file; under load it may land just after finish() returns
    deadline = time.monotonic() + 20
    while b"val_loss" not in run_files[0].read_bytes() and time.monotonic() < deadline:
        time.sleep(0.2)
    data = run_files[0].read_bytes()
    assert b"tokens_per_second_per_device" in data and b"val_loss" in data


def test_step_timer_rates_with_fake_clock():
    now = [10.0]
    timer = StepTimer(world_size=4, clock=lambda: now[0], synchronize=False)
    timer.start()
    timer.add_tokens(3000)
    timer.add_tokens(1000)
    now[0] = 12.0
    assert timer.rates() == {"tokens_per_second": 2000.0, "tokens_per_second_per_device": 500.0}
    timer.add_tokens(600)
    now[0] = 12.5  # the interval restarted at 12.0
    assert timer.rates() == {"tokens_per_second": 1200.0, "tokens_per_second_per_device": 300.0}


def test_progress_log_lines_when_not_a_tty():
    out = io.StringIO()
    progress = TrainingProgress(total_steps=5, rank=0, log_every_n_steps=2, stream=out)
    for step in range(1, 6):
        progress.update(step, {"loss": 1.0 / step, "lr": 1e-4, "tokens_per_second": 1234.4,
                               "peak_memory_gib": 0.5}, epoch=0)
    progress.close()
    lines = out.getvalue().splitlines()
    assert lines == [
        "step 2/5 | epoch 1 | loss 0.5000 | lr 1.00e-04 | tok/s 1234 | peak_mem 0.50GiB",
        "step 4/5 | epoch 1 | loss 0.2500 | lr 1.00e-04 | tok/s 1234 | peak_mem 0.50GiB",
        "step 5/5 | epoch 1 | loss 0.2000 | lr 1.00e-04 | tok/s 1234 | peak_mem 0.50GiB",
    ]


def test_progress_bar_and_silent_ranks():
    out = io.StringIO()
    with TrainingProgress(total_steps=4, initial_step=1, stream=out, use_bar=True) as progress:
        progress.update(2, {"loss": 0.5})
        progress.update(3, {"loss": 0.25})
        assert progress._bar.n == 3
    assert "loss=0.2500" in out.getvalue()
    quiet = io.StringIO()
    other = TrainingProgress(total_steps=4, rank=1, stream=quiet, use_bar=True)
    other.update(1, {"loss": 0.5})
    other.write("hello")
    other.close()
    assert quiet.getvalue() == ""
    assert format_metrics({"grad_norm": 2.0, "unknown": 1}) == {"grad_norm": "2.000"}


def test_step_timer_interval_bounds_with_fake_clock():
    """What :class:`StepTimer` counts, on a clock the test moves: tokens added before :meth:`start` are not in the
    interval; ``end=`` closes it at that reading, not now; ``reset=False`` keeps the interval open; an interval of
    no time is 0 tokens/s, not a division by zero.

    Mutations seen failing: ``start`` keeping earlier tokens (3200 tokens/s); ``end`` ignored (the rate to now,
    200 tokens/s); ``reset`` ignored (600 tokens/s: 300 over 0.5 s); ``elapsed >= 0`` (ZeroDivisionError)."""
    now = [0.0]
    timer = StepTimer(world_size=2, clock=lambda: now[0], synchronize=False)
    timer.add_tokens(7000)  # before the interval begins
    now[0] = 1.0
    timer.start()
    timer.add_tokens(1000)
    now[0] = 6.0
    assert timer.rates(end=3.5) == {"tokens_per_second": 400.0, "tokens_per_second_per_device": 200.0}
    timer.add_tokens(500)  # the next interval began at 3.5, the end passed
    now[0] = 4.0
    assert timer.rates(reset=False)["tokens_per_second"] == 1000.0
    timer.add_tokens(300)
    now[0] = 4.5
    assert timer.rates()["tokens_per_second"] == 800.0  # 800 tokens over 1.0 s: the interval was kept open
    assert timer.rates() == {"tokens_per_second": 0.0, "tokens_per_second_per_device": 0.0}  # no time passed
    with pytest.raises(RuntimeError, match="before StepTimer.start"):
        StepTimer(clock=lambda: 0.0, synchronize=False).rates()

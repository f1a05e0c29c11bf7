"""The progress display on terminals of every kind: plain lines where a bar cannot work, log lines through the bar,
evaluations with their own progress."""

import io
import logging
import os
import re
import shutil
import time

import pytest

from mtune.training.observe import progress as progress_module
from mtune.training.observe.progress import TrainingProgress, bar_fits

METRICS = {"loss": 0.5, "lr": 1e-4}


class FakeTerminal(io.StringIO):
    """A stream that says it is a terminal; its size is whatever ``os.get_terminal_size`` is patched to say."""

    def isatty(self):
        return True

    def fileno(self):
        return 2


@pytest.fixture
def terminal_size(monkeypatch):
    """Set the size every terminal reports: ``terminal_size(columns, lines)``."""

    def set_size(columns, lines):
        size = os.terminal_size((columns, lines))
        monkeypatch.setattr(os, "get_terminal_size", lambda *args: size)
        monkeypatch.setattr(shutil, "get_terminal_size", lambda *args, **kwargs: size)

    return set_size


@pytest.fixture
def mtune_console(monkeypatch):
    """The ``mtune`` logger set up as ``configure_logging`` does, writing to a fake terminal that is stderr."""
    out = FakeTerminal()
    monkeypatch.setattr("sys.stderr", out)
    logger = logging.getLogger("mtune")
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("mtune: %(message)s"))
    monkeypatch.setattr(logger, "handlers", [handler])
    monkeypatch.setattr(logger, "propagate", False)
    monkeypatch.setattr(logger, "level", logging.INFO)
    return out, logger, handler


def _screen_lines(text):
    """What a reader of the raw output sees as separate lines: split at newlines and carriage returns."""
    return [line for line in re.split(r"[\r\n]", text) if line]


def _run(progress, steps):
    for step in range(1, steps + 1):
        progress.update(step, METRICS, epoch=0)
    progress.close()


def test_terminal_reporting_zero_size_gets_plain_lines(terminal_size):
    terminal_size(0, 0)
    out = FakeTerminal()
    assert not bar_fits(out)
    progress = TrainingProgress(total_steps=3, stream=out)
    assert not progress.has_bar
    _run(progress, 3)
    assert out.getvalue().splitlines() == [f"step {i}/3 | epoch 1 | loss 0.5000 | lr 1.00e-04" for i in (1, 2, 3)]


def test_not_a_terminal_gets_plain_lines_without_carriage_returns(terminal_size):
    terminal_size(120, 40)  # a size is known, but the stream is a file
    out = io.StringIO()
    progress = TrainingProgress(total_steps=4, stream=out, log_every_n_steps=2)
    assert not progress.has_bar
    _run(progress, 4)
    assert "\r" not in out.getvalue()
    assert out.getvalue().splitlines() == ["step 2/4 | epoch 1 | loss 0.5000 | lr 1.00e-04",
                                           "step 4/4 | epoch 1 | loss 0.5000 | lr 1.00e-04"]


def test_sized_terminal_gets_a_bar(terminal_size):
    terminal_size(100, 30)
    out = FakeTerminal()
    progress = TrainingProgress(total_steps=3, stream=out)
    assert progress.has_bar
    _run(progress, 3)
    assert "\r" in out.getvalue() and "3/3" in out.getvalue() and "loss=0.5000" in out.getvalue()


def test_log_line_during_the_bar_appears_once_and_whole(terminal_size, mtune_console):
    terminal_size(100, 30)
    out, logger, handler = mtune_console
    # The test runner may add handlers of its own (pytest 9.2 attaches its log capture): compare with what the
    # logger holds when the test starts, not with a list written here.
    before = list(logger.handlers)
    assert handler in before
    progress = TrainingProgress(total_steps=3, stream=out)
    assert handler not in logger.handlers  # while the bar is up, the console handler writes through it
    progress.update(1, METRICS, epoch=0)
    logging.getLogger("mtune.training.checkpointing").info("saved step_1 to /runs/a/step_1")
    progress.update(2, METRICS, epoch=0)
    progress.close()
    assert logger.handlers == before  # the console handler is back once the bar is gone, nothing of the bar's left
    assert not any(isinstance(h, progress_module._WriteAboveBar) for h in logger.handlers)
    text = out.getvalue()
    assert text.count("saved step_1") == 1
    assert "mtune: saved step_1 to /runs/a/step_1" in _screen_lines(text)
    # Without a bar the handler is left alone: records go straight to it.
    plain = TrainingProgress(total_steps=3, stream=io.StringIO())
    assert logger.handlers == before
    plain.close()


def test_logger_without_console_handler_is_left_alone(terminal_size, monkeypatch):
    terminal_size(100, 30)
    logger = logging.getLogger("mtune")
    file_handler = logging.NullHandler()
    monkeypatch.setattr(logger, "handlers", [file_handler])
    before = list(logger.handlers)  # the test runner's own handlers, if it adds any, included
    progress = TrainingProgress(total_steps=2, stream=FakeTerminal())
    assert logger.handlers == before  # nothing added, so a propagated record is not printed twice
    progress.close()
    assert logger.handlers == before


def test_evaluation_has_its_own_bar(terminal_size, monkeypatch):
    terminal_size(100, 30)
    monkeypatch.setattr(progress_module, "_REFRESH_SECONDS", 0.01)
    out = FakeTerminal()
    progress = TrainingProgress(total_steps=3, stream=out)
    with progress.activity("task eval before training") as activity:
        time.sleep(0.2)  # nothing advances it: the bar is redrawn anyway, its elapsed time moving
    assert len(re.findall(r"task eval before training \[00:00\]", out.getvalue())) >= 3
    assert activity.seconds >= 0.2
    with progress.activity("val_loss", total=4, unit="batches") as activity:
        assert list(activity.count("abcd")) == list("abcd")
        time.sleep(0.1)  # let the redraw show where it stands
    assert re.search(r"val_loss: 100%\|#+\| 4/4 ", out.getvalue())
    _run(progress, 3)


def test_evaluation_without_a_bar_prints_a_starting_line():
    out = io.StringIO()
    progress = TrainingProgress(total_steps=3, stream=out)
    with progress.activity("val_loss", total=4, unit="batches") as activity:
        assert list(activity.count(range(4))) == [0, 1, 2, 3]
    with progress.activity("task eval before training"):
        pass
    progress.close()
    assert out.getvalue().splitlines() == ["val_loss: 4 batches ...", "task eval before training ..."]
    quiet = io.StringIO()
    with TrainingProgress(total_steps=3, rank=1, stream=quiet).activity("val_loss", total=4) as activity:
        activity.advance()
    assert quiet.getvalue() == ""


class _ValLoader(list):
    def set_epoch(self, epoch):
        self.epoch = epoch


def _session(tmp_path, monkeypatch):
    """A TrainingSession with only what val_loss and the task eval touch (a real monitor; evaluate faked)."""
    from types import SimpleNamespace

    import torch

    from mtune.training import session as session_module
    from mtune.training.observe.monitor import TrainingMonitor

    def fake_evaluate(model, batches, loss_fn, device, autocast):
        total = 0.0
        for batch in batches:
            time.sleep(0.05)
            total += batch
        return total

    monkeypatch.setattr(session_module, "evaluate", fake_evaluate)
    session = session_module.TrainingSession.__new__(session_module.TrainingSession)
    session.cfg, session.model, session.tokenizer, session.loss_fn, session.results = {}, None, None, None, {}
    session.run = SimpleNamespace(device=torch.device("cpu"), autocast=None)
    session.val_loader = _ValLoader([1, 2, 3])
    session.task_eval = lambda model, tokenizer: {"exact_match": 0.5, "num_samples": 2, "examples": []}
    session.monitor = TrainingMonitor(output_dir=tmp_path, device=torch.device("cpu"), total_steps=3)
    session._stop = session_module.GracefulStop()  # no signal comes: the evaluations run through
    return session


def test_session_evaluations_print_their_progress_in_plain_mode(tmp_path, monkeypatch, capsys):
    session = _session(tmp_path, monkeypatch)
    session._run_task_eval("before")
    assert session.val_loss() == 6.0
    session.monitor.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "task eval before training ..."
    assert re.fullmatch(r"task eval before training: exact_match 50\.0% on 2 samples \(\d+\.\d s\)", lines[1])
    assert lines[2:] == ["val_loss: 3 batches ..."]


def test_session_evaluations_get_a_bar_under_the_training_bar(tmp_path, monkeypatch, terminal_size):
    terminal_size(100, 30)
    monkeypatch.setattr(progress_module, "_REFRESH_SECONDS", 0.01)
    out = FakeTerminal()
    monkeypatch.setattr("sys.stderr", out)
    session = _session(tmp_path, monkeypatch)
    assert session.monitor.progress.has_bar
    assert session.val_loss() == 6.0
    session.monitor.close()
    assert re.search(r"val_loss: +\d+%\|#[^|]*\| [123]/3 ", out.getvalue())  # counted batches as they went

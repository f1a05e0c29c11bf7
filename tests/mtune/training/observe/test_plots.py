import pytest

from mtune.training.observe.metric_logging import JsonlLogger
from mtune.training.observe.plots import plot_loss_curve

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_loss_curve_png(tmp_path):
    logger = JsonlLogger(tmp_path)
    for step in range(1, 6):
        logger.log_dict({"loss": 3.0 / step, **({"val_loss": 2.0} if step == 5 else {})}, step=step)
    logger.close()
    out = plot_loss_curve(tmp_path / "metrics.jsonl", tmp_path / "plots" / "loss.png")
    assert out.read_bytes()[:8] == PNG_MAGIC and out.stat().st_size > 1000
    (tmp_path / "bad.jsonl").write_text('{"step": 1, "loss": 1}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2 is not JSON"):
        plot_loss_curve(tmp_path / "bad.jsonl", tmp_path / "x.png")


def test_nothing_to_plot_gives_no_png_and_no_warning(tmp_path):
    import warnings

    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "val_free.jsonl").write_text('{"step": 1, "lr": 0.1}\n')
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in ("empty.jsonl", "val_free.jsonl", "missing.jsonl"):
            assert plot_loss_curve(tmp_path / name, tmp_path / f"{name}.png") is None
    assert not list(tmp_path.glob("*.png"))


def test_one_logged_step_is_plotted(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 3, "loss": 1.25}\n')
    out = plot_loss_curve(tmp_path / "metrics.jsonl", tmp_path / "loss.png")
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_a_resumed_runs_rows_replace_the_steps_it_logs_again(tmp_path):
    """A run logged steps 1-4 and was resumed from its step-2 checkpoint: metrics.jsonl holds steps 3 and 4 twice
    (it is appended to), and the curve takes the resumed run's, in step order, instead of running back to step 3."""
    from mtune.training.observe.plots import _loss_series

    rows = [(1, 4.0), (2, 3.0), (3, 2.5), (4, 2.25), (3, 2.0), (4, 1.5), (5, 1.0)]
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "loss": {v}}}\n' for s, v in rows)
                                            + '{"step": 5, "val_loss": 1.75}\n')
    series = _loss_series(tmp_path / "metrics.jsonl")
    assert series == {"loss": ([1, 2, 3, 4, 5], [4.0, 3.0, 2.0, 1.5, 1.0]), "val_loss": ([5], [1.75])}

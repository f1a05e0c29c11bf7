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

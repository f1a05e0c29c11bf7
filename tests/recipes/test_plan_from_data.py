"""``mtune plan --from-data`` on the tiny config: the row lengths the dataset really produces (against the rows the
recipe's own loader yields) and the plan at the longest batch (against a plan whose max_seq_len is that length)."""

import statistics


from mtune._cli.catalog import find_recipe, load_recipe_module
from mtune._cli.run import load_and_check
from mtune.tokenizers import load_tokenizer
from mtune.training.planning.data_lengths import data_lengths
from mtune.training.planning.plan import plan_memory
from mtune.training.data_setup import setup_data
from tests._helpers.recipes import TRAIN_CONFIG, train_overrides


def _cfg(tmp_path, checkpoint, data, **changes):
    overrides = train_overrides(tmp_path, checkpoint, data, **{"dataset.cache": False, **changes})
    return load_and_check(load_recipe_module(find_recipe("lora_single_device")), TRAIN_CONFIG, overrides)


def _loader_rows(cfg):
    """Every batch the recipe's loader yields: (padded length, non-padding tokens per row)."""
    loader, _, _ = setup_data(cfg, load_tokenizer(cfg.model.checkpoint_dir, max_seq_len=cfg.tokenizer.max_seq_len))
    pad = loader.dataset.pad_id
    return [(int(b["tokens"].shape[-1]), (b["tokens"] != pad).sum(-1).tolist()) for b in loader]


def test_unpacked_lengths_and_the_plan_at_the_longest_batch(tmp_path, tiny_checkpoint, tiny_data):
    cfg = _cfg(tmp_path, tiny_checkpoint, tiny_data)
    lengths = data_lengths(cfg)
    batches = _loader_rows(cfg)
    rows = sorted(n for _, per_row in batches for n in per_row)  # drop_last: the loader may leave a few rows out
    assert lengths.longest_batch == lengths.max >= max(length for length, _ in batches)
    assert lengths.min <= rows[0] and lengths.max >= rows[-1] and not lengths.packed
    assert abs(lengths.median - statistics.median(rows)) <= 1 and lengths.max < cfg.tokenizer.max_seq_len
    assert f"longest batch: rows of {lengths.longest_batch} tokens" in lengths.line()
    planned = plan_memory(cfg, seq_len=lengths.longest_batch)
    oracle = plan_memory(_cfg(tmp_path, tiny_checkpoint, tiny_data, **{"tokenizer.max_seq_len": lengths.max}))
    assert planned.device_peak_bytes == oracle.device_peak_bytes
    assert planned.batch["seq_len"] == lengths.max
    assert planned.device_peak_bytes < plan_memory(cfg).device_peak_bytes  # rows shorter than max_seq_len


def test_packed_rows_are_max_seq_len_long(tmp_path, tiny_checkpoint, tiny_data):
    cfg = _cfg(tmp_path, tiny_checkpoint, tiny_data, **{"dataset.packed": True})
    lengths = data_lengths(cfg)
    batches = _loader_rows(cfg)
    assert lengths.packed and lengths.longest_batch == cfg.tokenizer.max_seq_len == batches[0][0]
    real = sorted(n for _, per_row in batches for n in per_row)
    assert lengths.min <= real[0] <= real[-1] <= lengths.max <= cfg.tokenizer.max_seq_len


def test_cli_prints_the_lengths(tmp_path, tiny_checkpoint, tiny_data, capsys):
    from mtune._cli.main import main

    overrides = train_overrides(tmp_path, tiny_checkpoint, tiny_data, **{"dataset.cache": False})
    assert main(["plan", "--from-data", "lora_single_device", "--config", str(TRAIN_CONFIG), *overrides]) == 0
    printed = capsys.readouterr().out
    assert "data: 48 samples (tokens per sample): min " in printed and "longest batch: rows of" in printed


def test_the_percentiles_are_read_off_the_sorted_lengths(monkeypatch):
    """40 rows of 1..40 tokens (shuffled): min 1, median the lower middle (sorted index 19: 20), p95 the sorted
    index int(0.95 * 40) = 38 (39 tokens), max 40. Mutations checked: median at index n // 2; p95 at 0.9."""
    from types import SimpleNamespace

    from mtune.training.planning import data_lengths as module

    rows = [{"tokens": [7] * n} for n in [*range(40, 20, -1), *range(1, 21)]]
    loader = SimpleNamespace(dataset=_Rows(rows))
    monkeypatch.setattr(module, "resolve_model_source", lambda model: None)
    monkeypatch.setattr(module, "setup_tokenizer", lambda tokenizer, source: None)
    monkeypatch.setattr(module, "setup_data", lambda cfg, tokenizer: (loader, None, None))
    lengths = module.data_lengths(SimpleNamespace(model=None, tokenizer=None))
    assert (lengths.rows, lengths.min, lengths.median, lengths.p95, lengths.max, lengths.longest_batch) == (
        40, 1, 20, 39, 40, 40)


class _Rows(list):
    """A dataset of rows given by hand, read row by row."""

    packed = False

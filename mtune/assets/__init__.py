"""Files shipped inside the mtune package: the built-in tiny model and its word-reversal task data.

``mtune/assets/tiny/model`` is a Hugging Face model directory (Llama 3 architecture, tiktoken tokenizer) made by
``scripts/make_tiny_model.py``; ``mtune/assets/tiny/data`` holds ``train.jsonl`` and ``eval.jsonl`` (columns
``instruction``, ``output``). Configs name them as ``${mtune_asset:tiny/model}`` and ``${mtune_asset:tiny/data}``.
No torch import here: the CLI's light commands use these paths.
"""

from __future__ import annotations

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent


def asset_path(name: str) -> Path:
    """The installed path of asset ``name`` (e.g. ``"tiny/model"``, ``"tiny/data/train.jsonl"``)."""
    path = ASSETS_DIR / name
    if not path.exists():
        shipped = sorted(str(p.relative_to(ASSETS_DIR)) for p in ASSETS_DIR.glob("*/*") if p.is_dir())
        raise FileNotFoundError(f"mtune asset {name!r} not found under {ASSETS_DIR}; shipped: {', '.join(shipped)}")
    return path


def tiny_model_dir() -> Path:
    """The built-in tiny model's Hugging Face directory (config, bf16 safetensors, tiktoken tokenizer)."""
    return asset_path("tiny/model")


def tiny_data_dir() -> Path:
    """The folder with the word-reversal task's ``train.jsonl`` (2000 rows) and ``eval.jsonl`` (100 rows)."""
    return asset_path("tiny/data")


__all__ = ["ASSETS_DIR", "asset_path", "tiny_data_dir", "tiny_model_dir"]

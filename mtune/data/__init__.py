"""Data: file and hub sources, instruction / chat / text builders, mixtures, packing, collation, the loader."""

from mtune.data.builders import alpaca_dataset, chat_dataset, instruct_dataset, text_completion_dataset
from mtune.data.collate import collate_padded
from mtune.data.common import IGNORE_INDEX, DataError, cache_dir
from mtune.data.loader import ResumableLoader, build_dataloader
from mtune.data.mixture import MixtureDataset, mixture_dataset
from mtune.data.packing import pack_samples
from mtune.data.preference import (
    PackedPreferenceDataset,
    PreferenceDataset,
    collate_packed_pairs,
    collate_preference,
    preference_dataset,
)
from mtune.data.sources import load_source
from mtune.data.tokenized import TokenizedDataset

__all__ = [
    "IGNORE_INDEX",
    "DataError",
    "MixtureDataset",
    "PreferenceDataset",
    "ResumableLoader",
    "TokenizedDataset",
    "alpaca_dataset",
    "build_dataloader",
    "cache_dir",
    "chat_dataset",
    "collate_preference",
    "collate_packed_pairs",
    "collate_padded",
    "instruct_dataset",
    "load_source",
    "mixture_dataset",
    "pack_samples",
    "preference_dataset",
    "PackedPreferenceDataset",
    "text_completion_dataset",
]

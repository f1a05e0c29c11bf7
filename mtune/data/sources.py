"""Where rows come from: local JSON / JSONL / Parquet / CSV / text files, or the Hugging Face hub via `datasets`.

`load_source` resolves a config's `source` / `data_files` / `split` the way torchtune and `datasets.load_dataset`
users expect, and returns a `RowSource`: a content fingerprint (for the cache) and a lazy reader of rows, each with
the place it came from ("data.jsonl line 7") so that bad rows can be named.
"""

from __future__ import annotations

import csv
import glob
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from mtune.data.common import DataError

FORMATS = {"json": "json", "jsonl": "json", "parquet": "parquet", "csv": "csv", "text": "text", "txt": "text"}
EXTENSIONS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
# What a compressed file starts with: mtune reads files as they are, so these are refused by name, not as bad text
# (bzip2's "BZh" is left out: plain text may start so)
_COMPRESSION = {b"\x1f\x8b": "gzip", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd", b"PK\x03\x04": "zip"}
_COMPRESSED_SUFFIXES = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".zst": "zstd", ".zip": "zip"}
SAMPLE_BY = ("line", "paragraph", "document")


@dataclass
class Row:
    data: dict[str, Any]
    where: str  # "path/to/file.jsonl line 7": used in error messages
    first: bool  # first row of its file: a column missing here is a column_map problem, not a bad row


@dataclass
class RowSource:
    fingerprint: str  # changes whenever the data does (file contents hash, or hub id + revision + datasets hash)
    description: str
    read: Callable[[], Iterator[Row]]


def load_source(
    source: str,
    data_files: str | list[str] | Mapping[str, Any] | None = None,
    split: str = "train",
    revision: str | None = None,
    sample_by: str = "line",
    load_dataset_kwargs: Mapping[str, Any] | None = None,
) -> RowSource:
    """Resolve `source` to rows.

    `source` is a format name (`json`, `jsonl`, `parquet`, `csv`, `text`) reading `data_files`; a local file or
    directory (every supported file under it, or the `data_files` patterns inside it); a directory written by
    `datasets.Dataset.save_to_disk`; or else a Hugging Face hub dataset id (or any `datasets` builder name) loaded
    with `datasets.load_dataset(source, split=split, data_files=data_files, revision=revision,
    **load_dataset_kwargs)` (``load_dataset_kwargs`` applies to those alone and is refused for local files).
    `data_files` may be a path, a glob, a list of them, or a `{split: files}` dict. Text files give one row
    `{"text": ...}` per line (default), blank-line separated paragraph, or whole file (`sample_by`).
    """
    load_kwargs = dict(load_dataset_kwargs or {})
    if sample_by not in SAMPLE_BY:
        raise DataError(f"sample_by={sample_by!r}: expected one of {', '.join(SAMPLE_BY)}")
    split_named = isinstance(data_files, Mapping)
    if split_named:  # {split: files}, as datasets.load_dataset takes (a DictConfig too)
        if split not in data_files:
            raise DataError(f"data_files has no split {split!r} (splits: {', '.join(map(str, data_files))})")
        data_files = data_files[split]
    local = source in FORMATS or Path(source).expanduser().exists()
    saved = local and any((Path(source).expanduser() / name).exists() for name in ("dataset_info.json",
                                                                                   "dataset_dict.json"))
    if local and not saved and not split_named and split != "train":
        # datasets.load_dataset calls local files one split, "train", and refuses any other: so does mtune
        raise DataError(f"split={split!r}: source={source!r} is read as one split, 'train'; to keep splits in "
                        f"files of their own, give data_files={{train: ..., {split}: ...}}")
    if load_kwargs and local and not (Path(source).expanduser() / "dataset_info.json").exists():
        raise DataError(f"load_dataset_kwargs {sorted(load_kwargs)} apply to hub datasets only; source={source!r} "
                        "is read by mtune itself")
    if source in FORMATS:
        if not data_files:
            raise DataError(f"source={source!r} needs data_files: the file(s) to read, e.g. data_files=train.{source}")
        return _local_source(_expand(data_files, Path(".")), FORMATS[source], sample_by)
    path = Path(source).expanduser()
    if path.is_file():
        return _local_source([path], _format_of(path), sample_by)
    if path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
            return _datasets_source(source, split, None, revision, load_kwargs, from_disk=True)
        if data_files:
            files = _expand(data_files, path)
        else:
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in EXTENSIONS)
        if not files:
            raise DataError(f"{source}: no data files in this directory (looked for {', '.join(EXTENSIONS)})")
        return _local_source(files, None, sample_by)
    if Path(source).suffix.lower() in EXTENSIONS or source.startswith(("/", "./", "../", "~")):
        raise DataError(f"source={source!r}: no such file or directory")
    return _datasets_source(source, split, data_files, revision, load_kwargs)


def _compressed(path: Path, how: str) -> DataError:
    return DataError(f"{path}: {how}-compressed: mtune reads data files uncompressed", "decompress it (gunzip, "
                     "unzstd, unxz, ...) and point source at the file it gives")


def _format_of(path: Path) -> str:
    fmt = EXTENSIONS.get(path.suffix.lower())
    if path.suffix.lower() in _COMPRESSED_SUFFIXES:
        raise _compressed(path, _COMPRESSED_SUFFIXES[path.suffix.lower()])
    if fmt is None:
        raise DataError(
            f"{path}: unknown file type {path.suffix!r}; supported: {', '.join(EXTENSIONS)} "
            "(or name the format with source=json|parquet|csv|text and data_files=...)"
        )
    return fmt


def _expand(data_files: str | list[str], root: Path) -> list[Path]:
    files: list[Path] = []
    for pattern in [data_files] if isinstance(data_files, str) else list(data_files):
        full = root / Path(str(pattern)).expanduser()
        matches = sorted(glob.glob(str(full), recursive=True)) if glob.has_magic(str(full)) else [str(full)]
        found = [Path(m) for m in matches if Path(m).is_file()]
        if not found:
            raise DataError(f"data_files: {full} matches no file")
        files.extend(found)
    return files


def _file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _local_source(files: list[Path], fmt: str | None, sample_by: str) -> RowSource:
    formats = [fmt or _format_of(f) for f in files]
    parts = [f"{f}:{_file_hash(p)}" for f, p in zip(formats, files)]
    fingerprint = hashlib.sha256("|".join(parts + [sample_by]).encode()).hexdigest()

    for path, f in zip(files, formats):
        if f != "parquet":  # a text format: its first bytes tell a compressed file named .jsonl or given by format
            with open(path, "rb") as handle:
                head = handle.read(6)
            how = next((name for magic, name in _COMPRESSION.items() if head.startswith(magic)), None)
            if how is not None:
                raise _compressed(path, how)

    def read() -> Iterator[Row]:
        for path, f in zip(files, formats):
            try:
                yield from _READERS[f](path, sample_by)
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})",
                                "save the file as UTF-8") from None
            except OSError as e:
                raise DataError(f"{path}: cannot read it ({e.strerror or e})") from None

    shown = str(files[0]) if len(files) == 1 else f"{len(files)} files under {Path(files[0]).parent}"
    return RowSource(fingerprint, shown, read)


def _read_json(path: Path, sample_by: str) -> Iterator[Row]:
    text = path.read_text(encoding="utf-8-sig")  # a UTF-8 byte-order mark (Windows editors write one) is no text
    if text.lstrip().startswith("["):  # one JSON array of objects
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            if not text[e.pos:].strip():  # the parser ran out of text: the array never closes
                raise DataError(f"{path}: malformed JSON, the file ends inside its array ({e.msg}): is it cut "
                                "short?") from None
            raise DataError(f"{path} line {e.lineno}: malformed JSON ({e.msg})") from None
        for i, row in enumerate(rows, 1):
            yield _object(row, f"{path} row {i}", i == 1)
        return
    first = True
    # JSON Lines, split at line ends only: splitlines() also splits at U+2028, U+0085..., which JSON strings may hold
    for lineno, line in enumerate(re.split(r"\r\n|\r|\n", text), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{path} line {lineno}: malformed JSON ({e.msg}); each line must be one JSON object"
            ) from None
        yield _object(row, f"{path} line {lineno}", first)
        first = False


def _object(row: Any, where: str, first: bool) -> Row:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object with named fields, got {type(row).__name__}")
    return Row(row, where, first)


def _read_csv(path: Path, sample_by: str) -> Iterator[Row]:
    with open(path, newline="", encoding="utf-8-sig") as f:  # a byte-order mark would join the first column's name
        reader = csv.DictReader(f, restkey=_EXTRA)
        for i, row in enumerate(reader, 1):
            if _EXTRA in row:  # an unquoted comma splits a value: the fields after it would shift, the last dropped
                named = len(reader.fieldnames)
                raise DataError(f"{path} row {i}: {named + len(row[_EXTRA])} fields, but the header names {named}; "
                                "quote a value that holds a comma (\"1,000\")")
            yield Row(dict(row), f"{path} row {i}", i == 1)


_EXTRA = object()  # DictReader's key for a row's fields past the header's


def _read_parquet(path: Path, sample_by: str) -> Iterator[Row]:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except pyarrow.ArrowException as e:  # not Parquet at all (its magic bytes), or cut short
        raise DataError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]})") from None
    i = 0
    for batch in parquet.iter_batches():
        for row in batch.to_pylist():
            i += 1
            yield Row(row, f"{path} row {i}", i == 1)


def _read_text(path: Path, sample_by: str) -> Iterator[Row]:
    text = path.read_text(encoding="utf-8-sig")
    if sample_by == "document":
        pieces = [(1, text)]
    elif sample_by == "paragraph":
        pieces = list(enumerate(text.split("\n\n"), 1))
    else:
        pieces = list(enumerate(text.splitlines(), 1))
    unit = "line" if sample_by == "line" else sample_by
    first = True
    for n, piece in pieces:
        if piece.strip():  # blank lines / paragraphs carry nothing to train on
            yield Row({"text": piece}, f"{path} {unit} {n}", first)
            first = False


_READERS = {"json": _read_json, "csv": _read_csv, "parquet": _read_parquet, "text": _read_text}


def _datasets_source(source, split, data_files, revision, load_kwargs, from_disk=False) -> RowSource:
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"source={source!r} is not a local file, directory or format name, so it is read with the Hugging Face "
            "`datasets` library, which is not installed: pip install 'mtune[datasets]' (or pip install datasets)"
        ) from None
    if from_disk:
        ds = datasets.load_from_disk(source)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(f"{source}: no split {split!r} (splits: {', '.join(ds)})")
            ds = ds[split]
    else:
        ds = datasets.load_dataset(source, split=split, data_files=data_files, revision=revision, **load_kwargs)
    # datasets' own fingerprint follows the files and revision it resolved; the id and revision make it readable.
    fingerprint = f"datasets:{source}@{revision or 'default'}:{split}:{getattr(ds, '_fingerprint', '')}"

    def read() -> Iterator[Row]:
        for i, row in enumerate(ds, 1):
            yield Row(dict(row), f"{source} ({split}) row {i}", i == 1)

    return RowSource(fingerprint, f"{source} ({split})", read)

"""Reading dataset files row by row: the one place that knows file formats (every dataset of aligner reads here).

Contract
- `read_rows(path) -> Iterator[Row]`: each `Row` is `(where, data)` with `where` a human location for error messages
  and `data` a dict (one row's columns; nested lists and structs as Python lists and dicts). Formats (docs/DATA.md):
  - JSON Lines (any file that is not Parquet; `.jsonl` by convention): one object per line, blank lines skipped;
    `where` is `file.jsonl:12` (line numbers from 1).
  - Parquet (recognised by its `PAR1` magic bytes, whatever the extension): `where` is `file.parquet row 12`
    (rows from 0, as `table[12]`). Needs `pyarrow`.
  - A directory written by HF `datasets`' `Dataset.save_to_disk` (`state.json` + `data-*.arrow`): `where` is
    `DIR row 12` (rows from 0, as `ds[12]`). Read with `pyarrow` alone (the Arrow stream files `state.json` lists, in
    order); `datasets` itself is not needed. A `DatasetDict` directory is refused, naming its splits.
  Rows come in file order; the file is streamed, never loaded whole.
- Problems with the file itself (missing, unreadable, not UTF-8, a line that is not a JSON object, a Parquet file
  pyarrow cannot read, `pyarrow` not installed) raise `DataError`, naming the file and line and saying what is
  expected. Problems with a row's content are the caller's: it raises `DataError(row.where, ...)` so the message
  names the same place.
- `DataError` is a `ValueError` whose message starts with the place; entry scripts print it as one line (exit 2).
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Iterator
from typing import NamedTuple

PARQUET_MAGIC = b"PAR1"
BATCH_ROWS = 1024  # rows per Arrow record batch read from Parquet (memory: one batch)


class DataError(ValueError):
    """A bad dataset file or row: `where` (file and line) first, then what is wrong and how to fix it."""

    def __init__(self, where: str, message: str):
        self.where = where
        super().__init__(f"{where}: {message}")


class Row(NamedTuple):
    where: str
    data: dict


def read_rows(path: str) -> Iterator[Row]:
    """The rows of `path` (see the module docstring for formats and errors)."""
    if os.path.isdir(path):
        yield from _saved_dataset(path)
        return
    if not os.path.isfile(path):
        raise DataError(path, "no such file")
    try:
        with open(path, "rb") as f:
            magic = f.read(len(PARQUET_MAGIC))
    except OSError as exc:
        raise DataError(path, f"cannot be read ({exc.strerror})") from exc
    if magic == PARQUET_MAGIC:
        yield from _parquet(path)
    else:
        yield from _jsonl(path)


def _jsonl(path: str) -> Iterator[Row]:
    try:
        f = open(path, encoding="utf-8")
    except OSError as exc:
        raise DataError(path, f"cannot be read ({exc.strerror})") from exc
    with f:
        lineno = 0
        while True:
            lineno += 1
            try:
                line = f.readline()
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}:{lineno}", f"is not UTF-8 text ({exc.reason})") from exc
            if not line:
                return
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{path}:{lineno}", f"not valid JSON ({exc.msg}); each line must be one JSON object"
                ) from None
            if not isinstance(data, dict):
                raise DataError(f"{path}:{lineno}", f"a JSON {type(data).__name__}, not an object: one object per line")
            yield Row(f"{path}:{lineno}", data)


def _pyarrow(path: str, what: str):
    """pyarrow, imported on first use (the jobs need it only for Parquet and saved datasets)."""
    try:
        return importlib.import_module("pyarrow")
    except ImportError:
        raise DataError(
            path, f"reading {what} needs the `pyarrow` package: pip install pyarrow (or pip install -e '.[data]')"
        ) from None


def _batches_rows(path: str, batches) -> Iterator[Row]:
    index = 0
    for batch in batches:
        for data in batch.to_pylist():
            yield Row(f"{path} row {index}", data)
            index += 1


def _parquet(path: str) -> Iterator[Row]:
    pa = _pyarrow(path, "Parquet")
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS)
        yield from _batches_rows(path, batches)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(path, f"cannot be read as Parquet ({exc})") from None


def _saved_dataset(path: str) -> Iterator[Row]:
    """A `Dataset.save_to_disk` directory: `state.json` lists the Arrow stream files (`_data_files`), in order."""
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        splits = sorted(n for n in os.listdir(path) if os.path.isfile(os.path.join(path, n, "state.json")))
        example = os.path.join(path, splits[0]) if splits else os.path.join(path, "train")
        raise DataError(path, f"is a DatasetDict with splits {splits}: give one split's directory, e.g. {example}")
    state_path = os.path.join(path, "state.json")
    if not os.path.isfile(state_path):
        raise DataError(
            path,
            "is a directory without state.json: give a .jsonl or .parquet file, or a directory written by "
            "datasets' Dataset.save_to_disk",
        )
    try:
        with open(state_path, encoding="utf-8") as f:
            files = [entry["filename"] for entry in json.load(f)["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(state_path, f"is not a datasets state.json with `_data_files` ({exc})") from None
    pa = _pyarrow(path, "a saved datasets directory")

    def batches():
        for name in files:
            file = os.path.join(path, name)
            try:
                reader = pa.ipc.open_stream(pa.memory_map(file))
            except (pa.ArrowException, OSError) as exc:
                raise DataError(file, f"cannot be read as an Arrow stream ({exc})") from None
            yield from reader

    yield from _batches_rows(path, batches())

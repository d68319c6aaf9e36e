"""Reading dataset files row by row: the one place that knows file formats (every dataset of aligner reads here).

Contract
- `read_rows(path) -> Iterator[Row]`: each `Row` is `(where, data)` with `where` a human location for error messages
  (`file.jsonl:12`, `file.parquet row 12`) and `data` a dict. Formats: JSON Lines (`.jsonl`, `.json` with one object
  per line; blank lines skipped), more may be added behind the same function (Parquet, a saved HF `datasets`
  directory) without changing callers.
- Problems with the file itself (missing, unreadable, not UTF-8, a line that is not a JSON object) raise
  `DataError`, naming the file and line and saying what is expected. Problems with a row's content are the caller's:
  it raises `DataError(row.where, ...)` so the message names the same place.
- `DataError` is a `ValueError` whose message starts with the place; entry scripts print it as one line (exit 2).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import NamedTuple


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
        raise DataError(path, "is a directory; give a .jsonl file (one JSON object per line)")
    if not os.path.isfile(path):
        raise DataError(path, "no such file")
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

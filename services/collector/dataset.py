"""Reading a prompt dataset: JSONL, JSON, Parquet, or a saved ``datasets`` directory.

A file that cannot be read at all is a ``StartupError`` naming the file (and the line, for JSON
Lines): the collector refuses to start. A row that reads but is not a prompt is not an error
here: the prompt source dead-letters it with its reason when its turn comes and goes on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlfleet.services.common.errors import StartupError


def load_records(path: str | Path) -> list[Any]:
    """Rows of a JSONL / JSON / Parquet file or a saved ``datasets`` directory."""
    path = Path(path)
    if not path.exists():
        raise StartupError(f"dataset_path: {path} does not exist")
    if path.is_dir():
        import datasets  # optional: only for `save_to_disk` directories

        try:
            return [dict(row) for row in datasets.load_from_disk(str(path))]
        except (FileNotFoundError, ValueError) as exc:
            raise StartupError(f"dataset_path: {path} is not a saved `datasets` directory: {exc}") from None
    if path.suffix == ".parquet":
        import pyarrow  # optional
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except (OSError, pyarrow.ArrowException) as exc:
            raise StartupError(f"dataset_path: {path} is not a readable Parquet file: {exc}") from None
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise StartupError(f"dataset_path: cannot read {path}: {exc}") from None
    if path.suffix == ".json":
        return _json_rows(path, text)
    return _json_lines(path, text)


def _json_rows(path: Path, text: str) -> list[Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise StartupError(f"dataset_path: {path} line {exc.lineno} column {exc.colno}: not JSON: {exc.msg}") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        return data["data"]
    if not isinstance(data, list):
        raise StartupError(f"dataset_path: {path}: expected a list of rows (or {{\"data\": [...]}})")
    return data


def _json_lines(path: Path, text: str) -> list[Any]:
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise StartupError(f"dataset_path: {path} line {number} column {exc.colno}: not JSON: {exc.msg}") from None
    return rows

"""Corpus readers for preprocessing, each split into contiguous chunks that workers read alone.

A chunk is ``(kind, path, start, stop)``: a byte range of a JSON-lines or text file (a line
belongs to the chunk holding its first byte), a row-group range of a parquet file, or a row
range of a ``datasets`` dataset saved with ``save_to_disk``.  Reading the chunks in order gives
the documents in file order, so the output does not depend on the number of workers.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Iterator

from ..errors import DataError, DataNotFoundError

JSON_SUFFIXES = (".json", ".jsonl", ".ndjson")
TEXT_SUFFIXES = (".txt", ".text")


def _kind_of(path: str) -> str:
    if os.path.isdir(path):
        if any(os.path.isfile(os.path.join(path, f)) for f in ("dataset_info.json", "dataset_dict.json", "state.json")):
            return "hf_disk"
        raise DataError(f"{path}: directory is not a datasets dataset saved with save_to_disk "
                         "(no dataset_info.json / dataset_dict.json)")
    lower = path.lower()
    if lower.endswith(".parquet"):
        return "parquet"
    if lower.endswith(TEXT_SUFFIXES):
        return "text"
    if lower.endswith(JSON_SUFFIXES):
        return "json"
    raise DataError(f"{path}: unknown input format (expected .json/.jsonl lines, .txt, .parquet, "
                     "or a saved datasets directory)")


def expand_inputs(inputs: list[str]) -> list[str]:
    paths = []
    for pattern in inputs:
        matches = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
        if not matches or not all(os.path.exists(m) for m in matches):
            raise DataNotFoundError(f"{pattern}: input not found")
        paths.extend(matches)
    return paths


def _load_hf(path: str, split: str | None):
    import datasets

    data = datasets.load_from_disk(path)
    if isinstance(data, datasets.DatasetDict):
        name = split or ("train" if "train" in data else None)
        if name not in data:
            raise DataError(f"{path}: saved DatasetDict has splits {sorted(data)}; choose one with --split")
        data = data[name]
    return data


def plan_chunks(paths: list[str], min_chunks_per_file: int, target_chunk_bytes: int,
                split: str | None = None) -> list[tuple]:
    """All chunks of all inputs, in reading order; at least ``min_chunks_per_file`` per file
    where the file is big enough."""
    chunks = []
    for path in paths:
        kind = _kind_of(path)
        if kind in ("json", "text"):
            size = os.path.getsize(path)
            count = max(min_chunks_per_file, -(-size // target_chunk_bytes), 1)
            bounds = [size * i // count for i in range(count + 1)]
            chunks += [(kind, path, a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        elif kind == "parquet":
            import pyarrow.parquet as pq

            try:
                groups = pq.ParquetFile(path).num_row_groups
            except Exception as exc:
                raise DataError(f"{path}: cannot read parquet ({exc})") from None
            count = max(1, min(groups, min_chunks_per_file))
            bounds = [groups * i // count for i in range(count + 1)]
            chunks += [(kind, path, a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        else:
            rows = len(_load_hf(path, split))
            count = max(1, min(rows, min_chunks_per_file))
            bounds = [rows * i // count for i in range(count + 1)]
            chunks += [(kind, path, a, b, split) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    return chunks


def _lines(path: str, start: int, stop: int) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb") as stream:
        if start > 0:
            stream.seek(start - 1)
            if stream.read(1) != b"\n":
                stream.readline()  # the partial line belongs to the previous chunk
        while True:
            position = stream.tell()
            if position >= stop:
                return
            line = stream.readline()
            if not line:
                return
            yield position, line


def _pick(record: dict, keys: list[str], where: str) -> dict:
    try:
        picked = {key: record[key] for key in keys}
    except KeyError as exc:
        raise DataError(f"{where}: no field {exc.args[0]!r} (have {sorted(record)[:10]}); "
                         "set --json-keys") from None
    except TypeError:
        raise DataError(f"{where}: expected a JSON object per line") from None
    for key, value in picked.items():  # null, numbers, lists would be tokenised as their repr ("None")
        if not isinstance(value, str):
            raise DataError(f"{where}: field {key!r} is {json.dumps(value)[:40]}, expected a string")
    return picked


def read_chunk(chunk: tuple, keys: list[str]) -> Iterator[tuple[dict, int]]:
    """Documents ``{key: text}`` of one chunk, each with its size in bytes (for MB/s)."""
    kind, path = chunk[0], chunk[1]
    if kind in ("json", "text"):
        for position, line in _lines(path, chunk[2], chunk[3]):
            stripped = line.strip()
            if not stripped:
                continue
            if kind == "text":
                yield {key: line.decode("utf-8").rstrip("\r\n") for key in keys}, len(line)
                continue
            try:
                record = json.loads(stripped)
            except ValueError as exc:
                raise DataError(f"{path}: byte {position}: invalid JSON line ({exc})") from None
            yield _pick(record, keys, f"{path}: byte {position}"), len(line)
    elif kind == "parquet":
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(path)
        missing = [k for k in keys if k not in parquet.schema_arrow.names]
        if missing:
            raise DataError(f"{path}: no column {missing[0]!r} (have {parquet.schema_arrow.names}); set --json-keys")
        for batch in parquet.iter_batches(row_groups=range(chunk[2], chunk[3]), columns=keys):
            columns = {k: batch.column(k).to_pylist() for k in keys}
            for row in range(batch.num_rows):
                doc = {k: columns[k][row] or "" for k in keys}
                yield doc, sum(len(v) for v in doc.values())
    else:
        data = _load_hf(path, chunk[4])
        missing = [k for k in keys if k not in data.column_names]
        if missing:
            raise DataError(f"{path}: no column {missing[0]!r} (have {data.column_names}); set --json-keys")
        for start in range(chunk[2], chunk[3], 1000):
            rows = data[start: min(start + 1000, chunk[3])]
            for i in range(len(rows[keys[0]])):
                doc = {k: rows[k][i] or "" for k in keys}
                yield doc, sum(len(v) for v in doc.values())

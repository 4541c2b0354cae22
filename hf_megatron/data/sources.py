"""Corpus readers for preprocessing, each split into contiguous chunks that workers read alone.

A chunk is ``(kind, path, start, stop)``: a byte range of a JSON-lines or text file (a line
belongs to the chunk holding its first byte), a row-group range of a parquet file, or (hub.py)
a row range of a ``datasets`` dataset (saved with ``save_to_disk`` or loaded by ``load_dataset``)
or a shard of a streamed one.  A gzip-compressed JSON-lines or text file (``.jsonl.gz``, as
Megatron-LM's preprocess_data reads with gzip.open) cannot be cut at byte offsets: it is one chunk,
its positions are offsets in the uncompressed stream.  Reading the chunks in order gives the documents in file order, so
the output does not depend on the number of workers.
"""
from __future__ import annotations

import glob
import gzip
import itertools
import json
import os
import sys
import zlib
from dataclasses import dataclass
from typing import Iterator

from ..errors import DataError, DataNotFoundError
from .hub import HF_SCHEME, HubSource, hub_column_batches, is_saved_to_disk, plan_hub_chunks

JSON_SUFFIXES = (".json", ".jsonl", ".ndjson")
TEXT_SUFFIXES = (".txt", ".text")


def _is_gzip(path) -> bool:
    return isinstance(path, str) and path.lower().endswith(".gz")


def _kind_of(path: str) -> str:
    if os.path.isdir(path):
        if is_saved_to_disk(path):
            return "hf_disk"
        raise DataError(f"{path}: directory is not a datasets dataset saved with save_to_disk "
                         "(no dataset_info.json / dataset_dict.json)")
    lower = path.lower()[:-len(".gz")] if _is_gzip(path) else path.lower()
    if _is_gzip(path) and not lower.endswith(JSON_SUFFIXES + TEXT_SUFFIXES):
        raise DataError(f"{path}: unknown gzip input (expected .json.gz/.jsonl.gz lines or .txt.gz)")
    if lower.endswith(".parquet"):
        return "parquet"
    if lower.endswith(TEXT_SUFFIXES):
        return "text"
    if lower.endswith(JSON_SUFFIXES):
        return "json"
    raise DataError(f"{path}: unknown input format (expected .json/.jsonl lines, .txt, either .gz, "
                     ".parquet, or a saved datasets directory)")


def resolve_sources(inputs: list[str], hf_dataset: str | None = None, hf_subset: str | None = None,
                    hf_split: str = "train", streaming: bool = False) -> list:
    """``--input`` items (``hf://NAME`` ones become HubSource) then ``--hf-dataset``, in order."""
    hub = lambda name: HubSource(name, hf_subset, hf_split, streaming)  # noqa: E731
    sources = [hub(item[len(HF_SCHEME):]) if item.startswith(HF_SCHEME) else item for item in inputs or []]
    if hf_dataset:
        sources.append(hub(hf_dataset))
    if not sources:
        raise DataNotFoundError("no input: give --input FILES or --hf-dataset NAME")
    return sources


def expand_inputs(inputs: list) -> list:
    """Paths with globs expanded (checked to exist); HubSource items pass through."""
    paths = []
    for pattern in inputs:
        if isinstance(pattern, HubSource):
            paths.append(pattern)
            continue
        matches = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
        if not matches or not all(os.path.exists(m) for m in matches):
            raise DataNotFoundError(f"{pattern}: input not found")
        paths.extend(matches)
    return paths


def plan_chunks(paths: list[str], min_chunks_per_file: int, target_chunk_bytes: int,
                split: str | None = None) -> list[tuple]:
    """All chunks of all inputs, in reading order; at least ``min_chunks_per_file`` per file
    where the file is big enough."""
    chunks = []
    for path in paths:
        if isinstance(path, HubSource):
            chunks += plan_hub_chunks(path, min_chunks_per_file)
            continue
        kind = _kind_of(path)
        if kind in ("json", "text") and _is_gzip(path):
            chunks.append((kind, path, 0, sys.maxsize))  # no random access into a gzip stream
        elif kind in ("json", "text"):
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
            chunks += plan_hub_chunks(HubSource(path, split=split or "train"), min_chunks_per_file)
    return chunks


@dataclass
class BlankLines:
    """The blank (whitespace-only) lines of a JSON-lines or text input: they hold no document and are
    skipped, as datasets' json loader (pyarrow.json) skips them -- Megatron-LM's preprocess_data.py
    fails on one (json.loads) -- and counted, so that preprocess says so (``warning``)."""
    count: int = 0
    first: int | None = None  # byte offset of the first one (into the uncompressed stream of a .gz)

    def add(self, position: int, count: int = 1) -> None:
        self.count += count
        self.first = position if self.first is None else min(self.first, position)

    def merge(self, other: "BlankLines") -> None:
        if other.count:
            self.add(other.first, other.count)

    def warning(self, path: str) -> str:
        return (f"{path}: skipped {self.count} blank line{'s' * (self.count > 1)} (whitespace only, no document), "
                f"the first at line {line_number(path, self.first)}")


def line_number(path: str, position: int) -> int:
    """The 1-based number of the line starting at byte ``position`` (for messages only: it reads the
    file up to there)."""
    lines, left = 1, position
    with (gzip.open if _is_gzip(path) else open)(path, "rb") as stream:
        while left > 0:
            block = stream.read(min(left, 1 << 24))
            if not block:
                break
            lines += block.count(b"\n")
            left -= len(block)
    return lines


def _lines(path: str, start: int, stop: int) -> Iterator[tuple[int, bytes]]:
    if _is_gzip(path):
        try:
            with gzip.open(path, "rb") as stream:
                position = 0
                for line in stream:
                    yield position, line
                    position += len(line)
        except (OSError, EOFError, zlib.error) as exc:
            raise DataError(f"{path}: cannot read gzip input ({exc})") from None
        return
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


def _pick(line: bytes, keys: list[str], chat: bool = False) -> dict:
    """The ``keys`` fields of one JSON line; a DataError says what is wrong, the caller says where."""
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise DataError(f"invalid JSON line ({exc})") from None
    try:
        picked = {key: record[key] for key in keys}
    except KeyError as exc:
        raise DataError(f"no field {exc.args[0]!r} (have {sorted(record)[:10]}); set --json-keys") from None
    except TypeError:
        raise DataError("expected a JSON object per line") from None
    for key, value in picked.items():  # null, numbers, lists would be tokenised as their repr ("None")
        if chat and isinstance(value, list):
            continue  # SFT chat messages: sft_records checks their structure
        if isinstance(value, list) and all(isinstance(part, str) for part in value):
            continue  # sentences of one document, as Megatron-LM's Encoder.encode takes them
        if not isinstance(value, str):
            raise DataError(f"field {key!r} is {json.dumps(value)[:40]}, expected a string or a list of strings")
    return picked


def read_chunk(chunk: tuple, keys: list[str], chat: bool = False, blank_lines: BlankLines | None = None
               ) -> Iterator[tuple[dict, int]]:
    """Documents ``{key: text}`` of one chunk, each with its size in bytes (for MB/s); ``chat``
    also lets a JSON list through (an SFT ``messages`` field).  Blank lines of JSON-lines and text
    files are skipped and counted in ``blank_lines`` (BlankLines says why)."""
    kind, path = chunk[0], chunk[1]
    if kind in ("json", "text"):
        for position, line in _lines(path, chunk[2], chunk[3]):
            stripped = line.strip()
            if not stripped:
                if blank_lines is not None:
                    blank_lines.add(position)
                continue
            if kind == "text":
                yield {key: line.decode("utf-8").rstrip("\r\n") for key in keys}, len(line)
                continue
            try:
                picked = _pick(stripped, keys, chat)
            except DataError as exc:
                raise DataError(f"{path}:{line_number(path, position)}: {exc}") from None
            yield picked, len(line)
    elif kind in ("hub", "hub_stream"):
        for columns in hub_column_batches(chunk, keys):
            yield from _column_documents(columns, keys)
    elif kind == "parquet":
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(path)
        missing = [k for k in keys if k not in parquet.schema_arrow.names]
        if missing:
            raise DataError(f"{path}: no column {missing[0]!r} (have {parquet.schema_arrow.names}); set --json-keys")
        for batch in parquet.iter_batches(row_groups=range(chunk[2], chunk[3]), columns=keys):
            yield from _column_documents({k: batch.column(k).to_pylist() for k in keys}, keys)


def record_place(chunk: tuple, index: int) -> str:
    """How an error names document ``index`` (0-based, as read_chunk yields them) of ``chunk``:
    ``file:line`` for a JSON-lines or text input (1-based, blank lines counted; a .gz's line in its
    decompressed text), else the chunk's start and the index.  The file is read again to find the
    line, so call it only when reporting an error."""
    kind, source = chunk[0], chunk[1]
    if kind in ("json", "text"):
        records = (position for position, line in _lines(source, chunk[2], chunk[3]) if line.strip())
        position = next(itertools.islice(records, index, None), None)
        if position is not None:
            return f"{source}:{line_number(source, position)}"
    name = getattr(source, "name", source)
    if kind == "hub":  # rows chunk[2]:chunk[3] of the dataset
        return f"{name}: row {chunk[2] + index} (0-based, as the dataset indexes it)"
    if kind == "parquet":  # row groups chunk[2]:chunk[3] of the file
        import pyarrow.parquet as pq
        metadata = pq.ParquetFile(source).metadata
        before = sum(metadata.row_group(i).num_rows for i in range(chunk[2]))
        return f"{name}: row {before + index} (0-based)"
    if kind == "hub_stream":
        return f"{name}: record {index} of stream shard {chunk[2]} of {chunk[3]}"
    return f"{name}: chunk from byte {chunk[2]}, record {index}"


def _column_documents(columns: dict[str, list], keys: list[str]) -> Iterator[tuple[dict, int]]:
    """Rows of a column batch as documents (a missing value reads as empty text), with sizes."""
    for row in range(len(columns[keys[0]])):
        doc = {k: columns[k][row] or "" for k in keys}
        yield doc, sum(len(v) if isinstance(v, str) else len(str(v)) for v in doc.values())

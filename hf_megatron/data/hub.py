"""Hugging Face ``datasets`` as a preprocessing input: ``--hf-dataset NAME`` / ``--input hf://NAME``.

``NAME`` goes to ``datasets.load_dataset`` as given: a Hub id (``allenai/c4``, with ``--hf-subset``
``en``), a local folder of data files, or a cached dataset (offline with ``HF_DATASETS_OFFLINE=1``).
A single data file (``.parquet``, ``.json``/``.jsonl``, ``.arrow``, ``.csv``, ``.txt``) is loaded
with its packaged builder (``load_dataset("parquet", data_files=FILE)``); a folder written by
``save_to_disk`` with ``load_from_disk``.  No loading script ever runs (datasets >= 4 has none,
and ``trust_remote_code`` is never passed).

Chunks, so workers read alone and the output does not depend on their number:

* map-style (default): ``("hub", source, row_start, row_stop)``; the dataset is the Arrow cache
  ``load_dataset`` writes, memory-mapped, loaded once per process (forked workers inherit it).
* ``--streaming``: ``("hub_stream", source, shard, shards)``, ``IterableDataset.shard(shards,
  shard, contiguous=True)``: contiguous blocks of the data files, so reading the shards in order
  reads the rows in order.  Nothing is downloaded or cached up front.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator

from ..errors import DataError, DataNotFoundError

HF_SCHEME = "hf://"
FILE_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".ndjson": "json",
                 ".arrow": "arrow", ".csv": "csv", ".txt": "text"}
ROWS_PER_CHUNK = 50_000  # keeps progress updates frequent on big datasets
_loaded: dict = {}


@dataclass(frozen=True)
class HubSource:
    """What ``load_dataset`` is asked for (picklable: it travels to the workers)."""
    name: str
    subset: str | None = None
    split: str = "train"
    streaming: bool = False

    def describe(self) -> str:
        return f"--hf-dataset {self.name}" + (f" --hf-subset {self.subset}" if self.subset else "")


def is_saved_to_disk(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f)) for f in
                                       ("dataset_info.json", "dataset_dict.json", "state.json"))


def _load(source: HubSource):
    import datasets

    if source.streaming and is_saved_to_disk(source.name):
        raise DataError(f"{source.describe()}: --streaming reads data files or Hub datasets, not a "
                        "save_to_disk folder (drop --streaming)")
    try:
        if is_saved_to_disk(source.name):
            data = datasets.load_from_disk(source.name)
            if isinstance(data, datasets.DatasetDict):
                if source.split not in data:
                    raise DataError(f"{source.name}: saved DatasetDict has splits {sorted(data)}, not "
                                    f"{source.split!r}; choose one with --split (--input) or --hf-split")
                data = data[source.split]
            return data
        suffix = os.path.splitext(source.name)[1].lower()
        if os.path.isfile(source.name) and suffix in FILE_BUILDERS:
            return datasets.load_dataset(FILE_BUILDERS[suffix], data_files=source.name, split=source.split,
                                         streaming=source.streaming)
        return datasets.load_dataset(source.name, source.subset, split=source.split, streaming=source.streaming)
    except DataError:
        raise
    except (FileNotFoundError, datasets.exceptions.DatasetNotFoundError, ConnectionError) as exc:
        raise DataNotFoundError(f"{source.describe()}: dataset not found ({_first_line(exc)})") from None
    except Exception as exc:  # bad split / subset names, unreadable files: datasets raises many types
        raise DataError(f"{source.describe()}: load_dataset failed ({type(exc).__name__}: {_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


def load_source(source: HubSource):
    """The dataset, loaded once per process."""
    if source not in _loaded:
        _loaded[source] = _load(source)
    return _loaded[source]


def plan_hub_chunks(source: HubSource, min_chunks: int) -> list[tuple]:
    data = load_source(source)
    if source.streaming:
        count = max(1, min(min_chunks, int(getattr(data, "n_shards", 1) or 1)))
        return [("hub_stream", source, i, count) for i in range(count)]
    rows = len(data)
    count = max(1, min(rows, max(min_chunks, -(-rows // ROWS_PER_CHUNK))))
    bounds = [rows * i // count for i in range(count + 1)]
    return [("hub", source, a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def _missing(names, keys, source: HubSource) -> None:
    missing = [k for k in keys if k not in (names or [])]
    if missing:
        raise DataError(f"{source.name}: no column {missing[0]!r} (have {list(names or [])}); set --json-keys")


def hub_column_batches(chunk: tuple, keys: list[str]) -> Iterator[dict[str, list]]:
    """Column batches ``{key: [values]}`` of one hub chunk, in row order."""
    kind, source = chunk[0], chunk[1]
    data = load_source(source)
    if kind == "hub":
        _missing(data.column_names, keys, source)
        data = data.select_columns(keys)
        for start in range(chunk[2], chunk[3], 1000):
            yield data[start: min(start + 1000, chunk[3])]
        return
    shard = data.shard(num_shards=chunk[3], index=chunk[2], contiguous=True) if chunk[3] > 1 else data
    if shard.column_names is not None:
        _missing(shard.column_names, keys, source)
    for batch in shard.iter(batch_size=1000):
        _missing(list(batch), keys, source)
        yield batch

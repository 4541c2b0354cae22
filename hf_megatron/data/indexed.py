"""Megatron's `MMIDIDX` indexed dataset: a raw token file (.bin) and its index (.idx).

Layout of ``prefix.idx`` (little endian), as megatron-core writes it::

    b"MMIDIDX\\x00\\x00"            9 bytes magic
    version            <Q        always 1
    dtype code         <B        1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    sequence_count     <Q        S
    document_count     <Q        D + 1 (document_indices starts with 0)
    sequence_lengths   int32[S]  tokens per sequence
    sequence_pointers  int64[S]  byte offset of each sequence in .bin  (= cumsum(lengths) * itemsize)
    document_indices   int64[D+1] sequence index where each document ends (0, e1, e2, ...)

``prefix.bin`` is the concatenation of all sequences, ``dtype`` each token; tokenizers with a
vocabulary under 65500 use uint16, larger ones int32.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from typing import Iterable, Sequence

import numpy as np

from ..errors import DataError, DataNotFoundError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8  # = 34

DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
               6: np.float64, 7: np.float32, 8: np.uint16}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


def optimal_dtype(vocab_size: int | None) -> type:
    """uint16 when every token id fits below 65500 (Megatron's rule), else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def _read_header(path: str) -> tuple[np.dtype, int, int]:
    try:
        with open(path, "rb") as stream:
            head = stream.read(HEADER_BYTES)
    except FileNotFoundError:
        hint = "; give the prefix without .bin / .idx" if path.endswith((".bin.idx", ".idx.idx")) else ""
        raise DataNotFoundError(f"{path}: index file not found (expected a Megatron .idx next to the .bin{hint})") from None
    except OSError as exc:  # a folder, unreadable
        raise DataError(f"{path}: cannot read the index ({exc.strerror})") from None
    if len(head) < len(MAGIC) or head[: len(MAGIC)] != MAGIC:
        raise DataError(f"{path}: not a Megatron MMIDIDX index (wrong magic {head[:9]!r}, expected {MAGIC!r})")
    if len(head) < HEADER_BYTES:
        raise DataError(f"{path}: truncated index header ({len(head)} of {HEADER_BYTES} bytes)")
    version, code, seq_count, doc_count = struct.unpack("<QBQQ", head[len(MAGIC):])
    if version != VERSION:
        raise DataError(f"{path}: unsupported index version {version}, expected {VERSION}")
    if code not in DTYPE_CODES:
        raise DataError(f"{path}: unknown dtype code {code}, expected one of {sorted(DTYPE_CODES)}")
    return np.dtype(DTYPE_CODES[code]), seq_count, doc_count


class IndexedDataset:
    """Read-only, memory-mapped view of ``prefix.bin`` / ``prefix.idx``.

    ``ds[i]`` is sequence ``i`` as a zero-copy numpy array; ``ds.get(i, offset, length)`` a slice
    of it, the access pattern of the GPT sample index.  Every inconsistency between the two files
    (truncation, pointer/length mismatch) is reported naming the file at open time.
    """

    def __init__(self, prefix: str):
        self.prefix = str(prefix)
        self.idx_file, self.bin_file = idx_path(self.prefix), bin_path(self.prefix)
        self.dtype, seq_count, doc_count = _read_header(self.idx_file)
        expected = HEADER_BYTES + seq_count * (4 + 8) + doc_count * 8
        actual = os.path.getsize(self.idx_file)
        if actual != expected:
            what = "truncated index" if actual < expected else "index longer than its header says"
            raise DataError(f"{self.idx_file}: {what} ({actual} bytes, header promises "
                             f"{seq_count} sequences and {doc_count} document entries = {expected} bytes)")
        index = np.memmap(self.idx_file, dtype=np.uint8, mode="r")
        self._index_map = index
        self.sequence_lengths = np.frombuffer(index, np.int32, seq_count, HEADER_BYTES)
        self.sequence_pointers = np.frombuffer(index, np.int64, seq_count, HEADER_BYTES + 4 * seq_count)
        self.document_indices = np.frombuffer(index, np.int64, doc_count, HEADER_BYTES + 12 * seq_count)
        if doc_count < 1:
            raise DataError(f"{self.idx_file}: corrupt index (no document entries; expected at least the leading 0)")
        if seq_count and int(self.sequence_lengths.min()) < 0:
            first = int(np.argmax(self.sequence_lengths < 0))
            raise DataError(f"{self.idx_file}: corrupt index (sequence {first} has negative length "
                             f"{int(self.sequence_lengths[first])})")
        if not os.path.isfile(self.bin_file):
            raise DataNotFoundError(f"{self.bin_file}: data file not found (the index {self.idx_file} exists)")
        itemsize = self.dtype.itemsize
        needed = int(self.sequence_lengths.astype(np.int64).sum()) * itemsize
        bin_size = os.path.getsize(self.bin_file)
        if bin_size != needed:
            what = "truncated" if bin_size < needed else "longer than its index says"
            raise DataError(f"{self.bin_file}: data file {what} ({bin_size} bytes, index {self.idx_file} "
                             f"describes {needed} bytes of {self.dtype.name})")
        if seq_count and (self.sequence_pointers[0] != 0 or not np.array_equal(
                np.diff(self.sequence_pointers), self.sequence_lengths[:-1].astype(np.int64) * itemsize)):
            raise DataError(f"{self.idx_file}: corrupt index (sequence pointers do not follow the lengths)")
        if self.document_indices[0] != 0 or self.document_indices[-1] != seq_count \
                or (doc_count > 1 and int(np.diff(self.document_indices).min()) < 0):
            raise DataError(f"{self.idx_file}: corrupt index (document indices must rise from 0 to "
                             f"{seq_count}, found {self.document_indices[0]}..{self.document_indices[-1]})")
        # an empty .bin cannot be memory-mapped
        self._data = np.memmap(self.bin_file, dtype=self.dtype, mode="r") if bin_size else np.empty(0, self.dtype)

    def token_range(self, cache_dir: str | None = None) -> tuple[int, int]:
        """(min, max) token id in .bin, read once: with `cache_dir` the result is kept there in
        `<name>-<md5 of path>-token-range.json`, valid while both files keep their size and mtime."""
        stamp = [[os.path.getsize(f), os.stat(f).st_mtime_ns] for f in (self.idx_file, self.bin_file)]
        cache = None
        if cache_dir is not None:
            key = hashlib.md5(os.path.abspath(self.bin_file).encode()).hexdigest()[:16]
            cache = os.path.join(cache_dir, f"{os.path.basename(self.prefix)}-{key}-token-range.json")
            try:
                with open(cache) as f:
                    saved = json.load(f)
                if saved["files"] == stamp:
                    return int(saved["min"]), int(saved["max"])
            except (OSError, ValueError, KeyError, TypeError):
                pass  # absent, stale or damaged: recompute
        low, high = 0, -1
        for start in range(0, len(self._data), 1 << 26):  # 64M tokens at a time: bounded memory
            block = self._data[start: start + (1 << 26)]
            low, high = (int(block.min()), int(block.max())) if high < low else \
                (min(low, int(block.min())), max(high, int(block.max())))
        if cache is not None:
            os.makedirs(cache_dir, exist_ok=True)
            tmp = f"{cache}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump({"files": stamp, "min": low, "max": high, "bin": os.path.abspath(self.bin_file)}, f)
            os.replace(tmp, cache)
        return low, high

    def check_token_ids(self, vocab_size: int, cache_dir: str | None = None) -> None:
        """Every token id must lie in [0, vocab_size): a DataError naming the file otherwise."""
        low, high = self.token_range(cache_dir)
        if high >= low and (low < 0 or high >= vocab_size):
            bad = low if low < 0 else high
            raise DataError(f"{self.bin_file}: token id {bad} outside the model's vocabulary [0, {vocab_size}) "
                             f"(tokenised with another tokenizer?)")

    def __reduce__(self):
        # reopen by path in DataLoader workers (spawn/forkserver) instead of copying the mapped data
        return IndexedDataset, (self.prefix,)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return max(len(self.document_indices) - 1, 0)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset : offset+length`` of sequence ``idx`` (to its end when length is None)."""
        start = int(self.sequence_pointers[idx]) // self.dtype.itemsize + int(offset)
        if length is None:
            length = int(self.sequence_lengths[idx]) - int(offset)
        return self._data[start: start + int(length)]

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    def document(self, doc: int) -> np.ndarray:
        """All tokens of document ``doc`` (its sequences are contiguous in .bin)."""
        first, last = int(self.document_indices[doc]), int(self.document_indices[doc + 1])
        if first == last:
            return self._data[:0]
        start = int(self.sequence_pointers[first]) // self.dtype.itemsize
        stop = int(self.sequence_pointers[last - 1]) // self.dtype.itemsize + int(self.sequence_lengths[last - 1])
        return self._data[start:stop]


def open_token_dataset(prefix: str) -> IndexedDataset:
    """IndexedDataset(prefix) holding token ids: a float dtype code (6, 7: valid MMIDIDX, never a
    tokenizer's output) is a DataError -- read as ids, its bytes would be garbage."""
    indexed = IndexedDataset(prefix)
    if indexed.dtype.kind == "f":
        code = CODE_OF_DTYPE[indexed.dtype]
        raise DataError(f"{indexed.idx_file}: dtype code {code} ({indexed.dtype.name}) holds no token ids; expected "
                        f"an integer code ({', '.join(f'{c} {np.dtype(t).name}' for c, t in DTYPE_CODES.items() if np.dtype(t).kind != 'f')})")
    return indexed


def _write_index(path: str, dtype: np.dtype, lengths: np.ndarray, doc_indices: np.ndarray) -> None:
    lengths = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    with open(path, "wb") as out:
        out.write(MAGIC)
        out.write(struct.pack("<QBQQ", VERSION, CODE_OF_DTYPE[np.dtype(dtype)], len(lengths), len(doc_indices)))
        out.write(lengths.tobytes())
        out.write(pointers.tobytes())
        out.write(np.asarray(doc_indices, dtype=np.int64).tobytes())


class IndexedDatasetWriter:
    """Write ``prefix.bin``/``prefix.idx`` (megatron-core's IndexedDatasetBuilder semantics).

    ``add_item(tokens)`` appends one sequence, ``end_document()`` closes the current document,
    ``add_document(tokens, lengths)`` does both for a document of several sequences,
    ``add_index(other_prefix)`` appends a whole dataset (merge).  Files are written under
    temporary names and renamed by ``finalize()``, so a crash never leaves a half dataset that
    looks complete.  Usable as a context manager (finalizes on success, cleans up on error).
    """

    def __init__(self, prefix: str, dtype=np.int32):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"{prefix}: unsupported token dtype {self.dtype}")
        parent = os.path.dirname(os.path.abspath(self.prefix))
        os.makedirs(parent, exist_ok=True)
        self._tmp_bin = bin_path(self.prefix) + f".tmp{os.getpid()}"
        self._bin = open(self._tmp_bin, "wb")
        self._lengths: list[np.ndarray] = []   # chunks of int32 lengths
        self._pending: list[int] = []          # lengths not yet chunked
        self._doc_ends: list[np.ndarray] = [np.zeros(1, np.int64)]
        self._num_sequences = 0

    def _flush_pending(self) -> None:
        if self._pending:
            self._lengths.append(np.asarray(self._pending, dtype=np.int32))
            self._pending = []

    def add_item(self, tokens: Sequence[int] | np.ndarray) -> None:
        array = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(array.tobytes())
        self._pending.append(array.size)
        self._num_sequences += 1

    def end_document(self) -> None:
        self._doc_ends.append(np.array([self._num_sequences], np.int64))

    def add_document(self, tokens: Sequence[int] | np.ndarray, lengths: Iterable[int]) -> None:
        array = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(array.tobytes())
        lengths = list(lengths)
        self._pending.extend(lengths)
        self._num_sequences += len(lengths)
        self.end_document()

    def add_index(self, prefix: str) -> None:
        """Append every sequence and document of dataset ``prefix`` (same dtype required)."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise DataError(f"{other.idx_file}: dtype {other.dtype.name} differs from the merged "
                             f"dataset's {self.dtype.name}")
        self._flush_pending()
        self._lengths.append(np.array(other.sequence_lengths, dtype=np.int32))
        self._doc_ends.append(other.document_indices[1:] + self._num_sequences)
        self._num_sequences += len(other)
        with open(other.bin_file, "rb") as src:
            shutil.copyfileobj(src, self._bin, 16 << 20)

    def finalize(self) -> None:
        self._bin.close()
        self._flush_pending()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        tmp_idx = idx_path(self.prefix) + f".tmp{os.getpid()}"
        _write_index(tmp_idx, self.dtype, lengths, np.concatenate(self._doc_ends))
        os.replace(self._tmp_bin, bin_path(self.prefix))
        os.replace(tmp_idx, idx_path(self.prefix))  # the index last: it is what readers open first

    def abort(self) -> None:
        self._bin.close()
        if os.path.exists(self._tmp_bin):
            os.remove(self._tmp_bin)

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def merge_datasets(prefixes: Sequence[str], output_prefix: str) -> None:
    """Concatenate several datasets (all of one dtype) into ``output_prefix``, in order."""
    if not prefixes:
        raise DataError("merge_datasets: no input prefixes given")
    dtype = IndexedDataset(prefixes[0]).dtype
    with IndexedDatasetWriter(output_prefix, dtype) as writer:
        for prefix in prefixes:
            writer.add_index(prefix)

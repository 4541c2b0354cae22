"""Indexed datasets refuse what megatron-core would read as garbage: negative sequence lengths
(even with pointers consistent with them), document indices that go backwards, and -- when the
model's vocabulary is known -- token ids outside it (checked once per file, cached by size and
mtime in the data cache)."""
from __future__ import annotations

import glob
import os
import struct

import numpy as np
import pytest

from hf_megatron.data import IndexedDataset, IndexedDatasetWriter, build_gpt_datasets
from hf_megatron.data.indexed import HEADER_BYTES, MAGIC, VERSION, CODE_OF_DTYPE
from hf_megatron.errors import DataError


def _write_raw(prefix, tokens, lengths, pointers, docs, dtype=np.uint16):
    with open(prefix + ".idx", "wb") as f:
        f.write(MAGIC + struct.pack("<QBQQ", VERSION, CODE_OF_DTYPE[np.dtype(dtype)], len(lengths), len(docs)))
        f.write(np.asarray(lengths, np.int32).tobytes() + np.asarray(pointers, np.int64).tobytes()
                + np.asarray(docs, np.int64).tobytes())
    np.asarray(tokens, dtype).tofile(prefix + ".bin")


def test_negative_length_with_consistent_pointers_is_refused(tmp_path):
    prefix = str(tmp_path / "neg")
    # lengths 5, -2, 3: pointers follow them (0, 10, 6) and the total (6 tokens) matches .bin
    _write_raw(prefix, np.arange(6), [5, -2, 3], [0, 10, 6], [0, 3])
    with pytest.raises(DataError, match=f"^{prefix}.idx: corrupt index \\(sequence 1 has negative length -2\\)"):
        IndexedDataset(prefix)


def test_backwards_document_indices_and_no_documents(tmp_path):
    prefix = str(tmp_path / "docs")
    _write_raw(prefix, np.arange(6), [2, 2, 2], [0, 4, 8], [0, 2, 1, 3])
    with pytest.raises(DataError, match="document indices must rise"):
        IndexedDataset(prefix)
    _write_raw(prefix, np.arange(6), [2, 2, 2], [0, 4, 8], [])
    with pytest.raises(DataError, match="no document entries"):
        IndexedDataset(prefix)
    assert os.path.getsize(prefix + ".idx") == HEADER_BYTES + 3 * 12


def _corpus(prefix: str, high: int) -> None:
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(60):
            writer.add_item(rng.integers(0, high, 40))
            writer.end_document()


def test_token_ids_beyond_the_vocabulary_are_refused_once_and_cached(tmp_path):
    prefix, cache = str(tmp_path / "corpus"), str(tmp_path / "cache")
    _corpus(prefix, 300)
    kwargs = dict(split="1,0,0", seq_length=16, cache_dir=cache)
    build_gpt_datasets(prefix, vocab_size=300, **kwargs)  # fits: fine
    with pytest.raises(DataError, match=f"^{prefix}.bin: token id 29\\d outside the model's vocabulary \\[0, 290\\)"):
        build_gpt_datasets(prefix, vocab_size=290, **kwargs)
    assert len(glob.glob(os.path.join(cache, "corpus-*-token-range.json"))) == 1
    # the cached range is used while size and mtime hold: same-size edit with the old mtime goes unseen...
    stat = os.stat(prefix + ".bin")
    data = np.fromfile(prefix + ".bin", np.uint16)
    data[7] = 5000
    data.tofile(prefix + ".bin")
    os.utime(prefix + ".bin", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    build_gpt_datasets(prefix, vocab_size=300, **kwargs)
    # ...and a new mtime makes it read again
    os.utime(prefix + ".bin")
    with pytest.raises(DataError, match="token id 5000 outside"):
        build_gpt_datasets(prefix, vocab_size=300, **kwargs)
    # without a vocabulary nothing is checked (preprocess-only use)
    build_gpt_datasets(prefix, **kwargs)

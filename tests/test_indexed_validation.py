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


# each damage of a cached index file: (how, expected text in the one-line error)
CACHE_DAMAGE = {
    "truncated": (lambda path: open(path, "r+b").truncate(os.path.getsize(path) // 2), "expected the .npy array"),
    "not npy": (lambda path: open(path, "wb").write(b"garbage" * 8), "not a .npy file"),
    "empty": (lambda path: open(path, "wb").close(), "not a .npy file"),
    "pickled": (lambda path: np.save(path, np.array([{"x": 1}], dtype=object), allow_pickle=True), "Python objects"),
    "float": (lambda path: np.save(path, np.load(path).astype(np.float64)), "found float64"),
    "out of range": (lambda path: np.save(path, np.load(path).astype(np.int64) + 10 ** 6), "found values"),
}


@pytest.mark.parametrize("damage", sorted(CACHE_DAMAGE))
def test_damaged_index_cache_files_are_refused_naming_them(tmp_path, damage):
    """--data-cache-path: a cached .npy that is damaged (or a foreign array under its name) is one DataError
    naming the file -- was a numpy traceback, an IndexError, or windows cut from garbage indices.  The intact
    cache, read back, still gives megatron-core's GPTDataset / BlendedDataset samples."""
    from data_oracle import mcore_datasets, write_random_corpus

    prefixes = [str(tmp_path / "a"), str(tmp_path / "b")]
    for seed, prefix in enumerate(prefixes):
        write_random_corpus(prefix, num_docs=80, seed=seed)
    edit, text = CACHE_DAMAGE[damage]
    for blend, mcore_blend, sizes in ((prefixes[0], ([prefixes[0]], None), (None, None, None)),
                                      (f"0.4 {prefixes[0]} 0.6 {prefixes[1]}", (prefixes, [0.4, 0.6]), (300, 20, 4))):
        cache = str(tmp_path / f"cache{len(mcore_blend[0])}")
        kwargs = dict(split="90,8,2", seq_length=16, seed=5, num_samples=sizes, cache_dir=cache)
        build_gpt_datasets(blend, **kwargs)
        train = build_gpt_datasets(blend, **kwargs)[0]  # from the cache
        ref = mcore_datasets(mcore_blend, "90,8,2", 16, 5, list(sizes))[0]
        assert len(train) == len(ref)
        for i in (0, len(ref) // 2, len(ref) - 1):
            np.testing.assert_array_equal(train[i], np.append(ref[i]["tokens"].numpy(), ref[i]["labels"][-1:].numpy()))
        for path in sorted(glob.glob(os.path.join(cache, "*-train-*.npy"))):
            saved = open(path, "rb").read()
            edit(path)
            with pytest.raises(DataError, match=f"^{path}: damaged index cache file .*{text}") as info:
                build_gpt_datasets(blend, **kwargs)
            assert "\n" not in str(info.value)
            open(path, "wb").write(saved)


def test_float_token_codes_and_trailing_index_bytes_are_refused(tmp_path):
    """megatron-core's IndexedDataset reads both (its builder accepts float dtypes): an int64 corpus whose
    .idx code says float64 (same item size, so .bin still matches) gave windows of zeros -- silently, even with
    the vocabulary check; bytes past the header's arrays were ignored.  Now each is one line naming the .idx."""
    import torch
    from data_oracle import IndexedDatasetBuilder

    prefix = str(tmp_path / "c")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int64)
    for i in range(20):
        builder.add_item(torch.arange(i, i + 30))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    kwargs = dict(split="1,0,0", seq_length=8, cache_dir=str(tmp_path / "cache"))
    assert build_gpt_datasets(prefix, **kwargs)[0][0].max() > 0
    raw = bytearray(open(prefix + ".idx", "rb").read())
    raw[len(MAGIC) + 8] = 6  # dtype code: int64 -> float64
    open(prefix + ".idx", "wb").write(bytes(raw))
    for vocab in (None, 100):
        with pytest.raises(DataError, match=f"^{prefix}.idx: dtype code 6 \\(float64\\) holds no token ids; expected "
                                            "an integer code"):
            build_gpt_datasets(prefix, vocab_size=vocab, **kwargs)
    raw[len(MAGIC) + 8] = 5
    open(prefix + ".idx", "wb").write(bytes(raw) + b"\0" * 8)
    with pytest.raises(DataError, match=f"^{prefix}.idx: index longer than its header says \\({len(raw) + 8} bytes"):
        IndexedDataset(prefix)
    with pytest.raises(DataError, match="give the prefix without .bin / .idx"):
        build_gpt_datasets(prefix + ".bin", **kwargs)

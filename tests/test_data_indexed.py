"""Indexed .bin/.idx files: byte compatibility with megatron-core 0.16.1 both ways, merge, bad files."""
import os
import pickle
import struct

import numpy as np
import pytest
import torch

from data_oracle import IndexedDataset as McoreIndexed
from data_oracle import IndexedDatasetBuilder, write_random_corpus
from hf_megatron.data import IndexedDataset, IndexedDatasetWriter, merge_datasets
from hf_megatron.data.indexed import optimal_dtype

# megatron-core's builder converts torch tensors through numpy.array(tensor): a numpy 2 notice
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _same_content(ours: IndexedDataset, theirs: McoreIndexed) -> None:
    assert ours.dtype == theirs.index.dtype
    np.testing.assert_array_equal(ours.sequence_lengths, theirs.sequence_lengths)
    np.testing.assert_array_equal(ours.sequence_pointers, theirs.index.sequence_pointers)
    np.testing.assert_array_equal(ours.document_indices, theirs.document_indices)
    assert len(ours) == len(theirs)
    for i in range(len(ours)):
        np.testing.assert_array_equal(ours[i], theirs[i])
        np.testing.assert_array_equal(ours.get(i, 1, 2)[:2], theirs.get(i, offset=1, length=2)[:2])


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_mcore_written_read_by_ours(tmp_path, dtype):
    prefix = str(tmp_path / "corpus")
    docs = write_random_corpus(prefix, 40, seed=3, dtype=dtype, sequences_per_doc=3)
    ours = IndexedDataset(prefix)
    _same_content(ours, McoreIndexed(prefix))
    assert ours.num_documents == len(docs)
    for d, sequences in enumerate(docs):
        np.testing.assert_array_equal(ours.document(d), np.concatenate(sequences))
    pickled = pickle.dumps(ours)  # DataLoader workers reopen by path, no copy of the data
    assert len(pickled) < 500
    np.testing.assert_array_equal(pickle.loads(pickled)[5], ours[5])


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_ours_written_is_byte_identical_and_read_by_mcore(tmp_path, dtype):
    rng = np.random.default_rng(5)
    ours_prefix, mcore_prefix = str(tmp_path / "ours"), str(tmp_path / "mcore")
    builder = IndexedDatasetBuilder(mcore_prefix + ".bin", dtype=dtype)
    with IndexedDatasetWriter(ours_prefix, dtype) as writer:
        for d in range(30):
            lengths = [int(n) for n in rng.integers(1, 20, size=int(rng.integers(1, 4)))]
            tokens = rng.integers(0, 60000, size=sum(lengths))
            if d % 2:  # both APIs: one call per document, and item by item
                writer.add_document(tokens, lengths)
                builder.add_document(torch.from_numpy(tokens), lengths)
            else:
                start = 0
                for n in lengths:
                    writer.add_item(tokens[start:start + n])
                    builder.add_item(torch.from_numpy(tokens[start:start + n]))
                    start += n
                writer.end_document()
                builder.end_document()
    builder.finalize(mcore_prefix + ".idx")
    for suffix in (".bin", ".idx"):
        assert open(ours_prefix + suffix, "rb").read() == open(mcore_prefix + suffix, "rb").read()
    _same_content(IndexedDataset(ours_prefix), McoreIndexed(ours_prefix))


def test_merge_matches_mcore_add_index(tmp_path):
    parts = [str(tmp_path / f"part{i}") for i in range(3)]
    for i, prefix in enumerate(parts):
        write_random_corpus(prefix, 10 + i, seed=i, sequences_per_doc=2)
    merge_datasets(parts, str(tmp_path / "merged"))
    builder = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=np.uint16)
    for prefix in parts:
        builder.add_index(prefix)
    builder.finalize(str(tmp_path / "ref.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"merged{suffix}").read_bytes() == (tmp_path / f"ref{suffix}").read_bytes()


def test_optimal_dtype_rule():
    assert optimal_dtype(65499) is np.uint16 and optimal_dtype(65500) is np.int32
    assert optimal_dtype(152064) is np.int32


@pytest.fixture
def good_prefix(tmp_path):
    prefix = str(tmp_path / "good")
    write_random_corpus(prefix, 12, seed=1)
    return prefix


def _expect_error(prefix, path_in_message, fragment, exc=ValueError):
    with pytest.raises(exc) as info:
        IndexedDataset(prefix)
    message = str(info.value)
    assert path_in_message in message and fragment in message, message


def test_wrong_magic(good_prefix):
    data = bytearray(open(good_prefix + ".idx", "rb").read())
    data[:9] = b"NOTMMIDX\x00"
    open(good_prefix + ".idx", "wb").write(bytes(data))
    _expect_error(good_prefix, good_prefix + ".idx", "magic")


def test_bad_version_and_dtype_code(good_prefix):
    data = bytearray(open(good_prefix + ".idx", "rb").read())
    original = bytes(data)
    data[9:17] = struct.pack("<Q", 2)
    open(good_prefix + ".idx", "wb").write(bytes(data))
    _expect_error(good_prefix, good_prefix + ".idx", "version")
    data = bytearray(original)
    data[17] = 42
    open(good_prefix + ".idx", "wb").write(bytes(data))
    _expect_error(good_prefix, good_prefix + ".idx", "dtype code")


def test_truncated_idx(good_prefix):
    data = open(good_prefix + ".idx", "rb").read()
    open(good_prefix + ".idx", "wb").write(data[:-5])
    _expect_error(good_prefix, good_prefix + ".idx", "truncated")
    open(good_prefix + ".idx", "wb").write(data[:20])
    _expect_error(good_prefix, good_prefix + ".idx", "truncated")


def test_truncated_bin(good_prefix):
    data = open(good_prefix + ".bin", "rb").read()
    open(good_prefix + ".bin", "wb").write(data[:-2])
    _expect_error(good_prefix, good_prefix + ".bin", "truncated")


def test_corrupt_pointers(good_prefix):
    data = bytearray(open(good_prefix + ".idx", "rb").read())
    count = struct.unpack("<Q", data[18:26])[0]
    pointer_at = 34 + 4 * count + 8  # second sequence pointer
    data[pointer_at:pointer_at + 8] = struct.pack("<q", 3)
    open(good_prefix + ".idx", "wb").write(bytes(data))
    _expect_error(good_prefix, good_prefix + ".idx", "corrupt")


def test_missing_files(good_prefix):
    os.remove(good_prefix + ".bin")
    _expect_error(good_prefix, good_prefix + ".bin", "not found", FileNotFoundError)
    os.remove(good_prefix + ".idx")
    _expect_error(good_prefix, good_prefix + ".idx", "not found", FileNotFoundError)


def test_merge_dtype_mismatch_names_file(tmp_path):
    write_random_corpus(str(tmp_path / "small"), 5, seed=0, dtype=np.uint16)
    write_random_corpus(str(tmp_path / "large"), 5, seed=0, dtype=np.int32)
    with pytest.raises(ValueError, match="large.idx.*int32"):
        merge_datasets([str(tmp_path / "small"), str(tmp_path / "large")], str(tmp_path / "out"))
    assert not (tmp_path / "out.idx").exists() and not (tmp_path / "out.bin").exists()

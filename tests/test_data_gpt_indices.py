"""GPT document/sample/shuffle indices and blending indices equal megatron-core 0.16.1's arrays."""
import os

import numpy as np
import pytest

from data_oracle import IndexedDataset as McoreIndexed
from data_oracle import mcore_datasets, write_random_corpus
from hf_megatron.data import build_gpt_datasets
from hf_megatron.data.gpt_dataset import BlendedDataset

GPT_ARRAYS = ("document_index", "sample_index", "shuffle_index")


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpora")
    # >= 1000 documents so that "969,30,1" leaves every split non-empty (megatron-core loops
    # forever on an empty split)
    write_random_corpus(str(root / "a"), 1000, seed=0, max_len=50)
    write_random_corpus(str(root / "b"), 1200, seed=1, max_len=30, sequences_per_doc=2)
    return root


def _window(sample, extra=True):
    """megatron-core's (tokens, labels) back to the raw window it cut from the corpus."""
    tokens = sample["tokens"].numpy()
    return np.concatenate([tokens, sample["labels"].numpy()[-1:]]) if extra else tokens


def _assert_gpt_equal(ours, theirs):
    assert len(ours) == len(theirs)
    for name in GPT_ARRAYS:
        a, b = getattr(ours, name), getattr(theirs, name)
        assert a.dtype == b.dtype, name
        np.testing.assert_array_equal(a, b, err_msg=name)
    for k in {0, len(theirs) // 2, len(theirs) - 1}:  # sample windows too
        np.testing.assert_array_equal(ours[k], _window(theirs[k], ours.extra == 1))


def _assert_blend_equal(ours, theirs):
    assert isinstance(ours, BlendedDataset)
    np.testing.assert_array_equal(ours.dataset_index, theirs.dataset_index)
    assert ours.dataset_index.dtype == theirs.dataset_index.dtype
    np.testing.assert_array_equal(ours.dataset_sample_index, theirs.dataset_sample_index)
    for mine, ref in zip(ours.datasets, theirs.datasets):
        _assert_gpt_equal(mine, ref)


def _per_epoch(prefix, seq):
    """Samples in one epoch of the train split of "969,30,1" (megatron's formula, from its reader)."""
    reader = McoreIndexed(prefix)  # keep it alive: it unmaps its arrays when collected
    tokens = int(reader.sequence_lengths[:969].sum())
    return (tokens - 1) // seq


# (split, seq_length, seed, sizes, add_extra_token): one epoch; three epochs with the last one
# merged (it gives >= 80% of an epoch) and separated (< 80%); two splits; no extra token.
# A float size f means f epochs' worth of train samples.
SINGLE_CONFIGS = {
    "one_epoch": ("969,30,1", 16, 1234, [None, None, None], True),
    "epochs_merged": ("969,30,1", 16, 7, [2.9, 100, 10], True),
    "epochs_separate_final": ("969,30,1", 16, 7, [2.1, 100, 10], True),
    "two_splits": ("90,10", 24, 99, [500, 60, None], True),
    "no_extra_token": ("969,30,1", 8, 3, [4000, 20, 5], False),
}


@pytest.mark.parametrize("name", sorted(SINGLE_CONFIGS))
def test_single_prefix_indices_equal_mcore(corpora, tmp_path, name):
    split, seq, seed, sizes, extra = SINGLE_CONFIGS[name]
    prefix = str(corpora / "a")
    if isinstance(sizes[0], float):
        sizes = [int(sizes[0] * _per_epoch(prefix, seq))] + sizes[1:]
    theirs = mcore_datasets(([prefix], None), split, seq, seed, sizes, extra)
    ours = build_gpt_datasets(prefix, split, seq, seed, tuple(sizes), cache_dir=str(tmp_path),
                              add_extra_token=extra)
    for mine, ref in zip(ours, theirs):
        assert (mine is None) == (ref is None)
        if ref is not None:
            _assert_gpt_equal(mine, ref)
    train = ours[0]
    epochs = len(train.document_index) // len(np.unique(train.document_index))
    if name.startswith("epochs"):
        assert epochs == 3
        last = np.sort(train.document_index[-len(train.document_index) // 3:])
        # the separately shuffled final epoch holds every document exactly once
        assert np.array_equal(last, np.unique(train.document_index)) == (name == "epochs_separate_final")


@pytest.mark.parametrize("weights,sizes", [([0.3, 0.7], [3000, 80, 20]), ([2, 1], [500, 40, None]),
                                           (None, [800, 30, 10]), (None, [None, None, None])])
def test_blend_indices_equal_mcore(corpora, tmp_path, weights, sizes):
    prefixes = [str(corpora / "a"), str(corpora / "b")]
    # megatron-core cannot size a weighted split from None: give it a count, compare the others
    mcore_sizes = sizes if weights is None else [4 if n is None else n for n in sizes]
    theirs = mcore_datasets((prefixes, weights), "969,30,1", 16, 1234, mcore_sizes)
    if weights is None:
        blend = " ".join(prefixes)
    else:
        blend = f"{weights[0]} {prefixes[0]} {weights[1]} {prefixes[1]}"
    ours = build_gpt_datasets(blend, "969,30,1", 16, 1234, tuple(sizes), cache_dir=str(tmp_path))
    if weights is not None and sizes[2] is None:  # megatron-core cannot size it; we skip the split
        assert ours[2] is None
        ours, theirs = ours[:2], theirs[:2]
    for mine, ref in zip(ours, theirs):
        _assert_blend_equal(mine, ref)
        k = len(ref) // 3
        np.testing.assert_array_equal(mine[k], _window(ref[k]))


@pytest.mark.parametrize("seq", [16, 23])
def test_partial_validation_window_kept_and_padded(corpora, tmp_path, seq):
    """drop_last_partial_validation=False: megatron-core's extra, padded last valid sample."""
    from hf_megatron.data import batch_iterator

    prefix = str(corpora / "a")
    ref = mcore_datasets(([prefix], None), "969,30,1", seq, 11, [None, None, None],
                         drop_last_partial_validation=False)[1]
    ours = build_gpt_datasets(prefix, "969,30,1", seq, 11, (None, None, None), cache_dir=str(tmp_path),
                              drop_last_partial_validation=False)[1]
    _assert_gpt_equal(ours, ref)
    last = int(np.flatnonzero(np.asarray(ours.shuffle_index) == len(ours) - 1)[0])
    batches = list(batch_iterator(ours, 1, 0, 1, drop_last=False))
    window = ref[last]["tokens"].numpy()
    pad = ref[last]["loss_mask"].numpy() == 0  # megatron-core masks the padding out of the loss
    assert pad.any()
    targets = batches[last]["targets"][0].numpy()  # aligned: token t is scored against targets[t]
    assert (targets[pad] == -100).all() and (targets[~pad] == ref[last]["labels"].numpy()[~pad]).all()
    assert (batches[last]["input_ids"][0].numpy()[~pad] == window[~pad]).all()


@pytest.mark.parametrize("path", ["compiled", "python"])
def test_blending_schedules_equal_mcore_helper(monkeypatch, path):
    """Both our schedule loops (C helper, pure-Python fallback) vs megatron-core's C++ helper."""
    from data_oracle import mcore_helpers
    from hf_megatron.data import blending, compiled

    if path == "python":
        monkeypatch.setattr(compiled, "blend_schedule", lambda *args: None)
    else:
        assert compiled.load() is not None, "no C compiler here: the compiled path is untested"
    rng = np.random.default_rng(7)
    for trial in range(40):
        count = int(rng.integers(1, 6))
        raw = [1.0] * count if trial % 4 == 0 else list(rng.random(count) * 10)  # exact ties too
        weights = blending.normalize(raw)
        size = int(rng.integers(0, 2000))
        expected = (np.zeros(size, np.int16), np.zeros(size, np.int64))
        mcore_helpers.build_blending_indices(*expected, weights, count, size, False)
        for mine, ref in zip(blending.build_blending_indices(weights, size), expected):
            assert mine.dtype == ref.dtype and np.array_equal(mine, ref), trial
        sizes = rng.integers(1, 300, size=count).astype(np.int64)
        expected = (np.zeros(sizes.sum(), np.int16), np.zeros(sizes.sum(), np.int64))
        mcore_helpers.build_exhaustive_blending_indices(*expected, sizes, count)
        for mine, ref in zip(blending.build_exhaustive_blending_indices(sizes), expected):
            assert np.array_equal(mine, ref), trial


def test_cache_reused_and_rebuilt_on_change(corpora, tmp_path):
    prefix = str(corpora / "a")
    first = build_gpt_datasets(prefix, "969,30,1", 16, 5, (300, 10, 2), cache_dir=str(tmp_path))[0]
    files = sorted(os.listdir(tmp_path))
    assert len([f for f in files if f.endswith("description.json")]) == 3
    again = build_gpt_datasets(prefix, "969,30,1", 16, 5, (300, 10, 2), cache_dir=str(tmp_path))[0]
    assert isinstance(again.shuffle_index, np.memmap)  # loaded, not rebuilt
    assert sorted(os.listdir(tmp_path)) == files
    for name in GPT_ARRAYS:
        np.testing.assert_array_equal(getattr(first, name), getattr(again, name))
    changed = build_gpt_datasets(prefix, "969,30,1", 16, 6, (300, 10, 2), cache_dir=str(tmp_path))[0]
    assert not isinstance(changed.shuffle_index, np.memmap) and changed.hash != first.hash
    assert len(os.listdir(tmp_path)) == 2 * len(files)


def test_blend_dtype_mismatch_names_file(tmp_path):
    write_random_corpus(str(tmp_path / "u16"), 50, seed=0, dtype=np.uint16)
    write_random_corpus(str(tmp_path / "i32"), 50, seed=0, dtype=np.int32)
    with pytest.raises(ValueError, match="i32.idx.*int32.*u16.idx"):
        build_gpt_datasets(f"1 {tmp_path}/u16 1 {tmp_path}/i32", "1", 8, 1, (10, 0, 0), cache_dir=None)


def test_missing_prefix_and_empty_split_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothere.idx"):
        build_gpt_datasets(str(tmp_path / "nothere"), "1", 8, 1, (10, 0, 0), cache_dir=None)
    write_random_corpus(str(tmp_path / "small"), 300, seed=0)
    # "969,30,1" over 300 documents leaves the test split empty: megatron-core hangs, we say so
    with pytest.raises(ValueError, match="small.idx: the test split has 0 sequences"):
        build_gpt_datasets(str(tmp_path / "small"), "969,30,1", 8, 1, (10, 2, 1), cache_dir=None)


def test_split_strings_megatron_core_reads_and_the_ones_it_misreads():
    """Plain shares parse as megatron-core's parse_and_normalize_split does; what its digit-run regex misreads
    ("-1,2,0" -> 1,2,0; "1e3,1" -> 1,3,1; "1.2.3" -> a ValueError) was silently taken too, and is now one
    DataError naming --split."""
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    from hf_megatron.data import split_bookends
    from hf_megatron.errors import DataError

    for split in ("969,30,1", "98,2", "1", "90/5/5", "969, 30, 1", "0.5,.25,0.25", "0,1,0"):
        theirs = parse_and_normalize_split(split)
        ours = [0.0 if ends is None else ends[1] - ends[0] for ends in split_bookends(split)]
        np.testing.assert_allclose(ours, theirs, rtol=1e-12, err_msg=split)
    for split in ("-1,2,0", "1e3,1", "1.2.3,1", "1,,1", "a,b", "1;2;3", "0,0,0"):
        with pytest.raises(DataError, match=f"^--split '{split}': expected up to three non-negative numbers"):
            split_bookends(split)


@pytest.mark.parametrize("sizes", [(-5, None, None), (10, 2.5, None), (True, None, None), (10, None)])
def test_bad_num_samples_is_one_config_error(tmp_path, sizes):
    """A negative count built a one-epoch train split (single prefix) or hit numpy's 'negative dimensions'
    (blend); a float or bool was taken as a count.  Now one ConfigError naming num_samples."""
    from hf_megatron.errors import ConfigError

    write_random_corpus(str(tmp_path / "c"), 50, seed=0)
    for blend in (str(tmp_path / "c"), f"1 {tmp_path}/c 1 {tmp_path}/c"):
        with pytest.raises(ConfigError, match="^num_samples: expected \\(train, valid, test\\), each None or an integer"):
            build_gpt_datasets(blend, "1,1,0", 8, 1, sizes, cache_dir=None)


@pytest.mark.parametrize("seq_length, cache", [(1, None), (0, None), (8.0, None), (8, "file")])
def test_bad_seq_length_or_a_file_as_cache_dir_is_one_config_error(tmp_path, seq_length, cache):
    """Were a ValueError from the index builder and a FileExistsError from os.makedirs."""
    from hf_megatron.errors import ConfigError

    write_random_corpus(str(tmp_path / "c"), 50, seed=0)
    (tmp_path / "file").write_text("not a folder")
    cache_dir = str(tmp_path / "file" / "cache") if cache else None
    expected = "^cache_dir .*/file/cache: expected a folder, .*/file is a file$" if cache else \
        f"^seq_length: expected an integer >= 2 \\(tokens per sample\\), got {seq_length!r}$"
    with pytest.raises(ConfigError, match=expected):
        build_gpt_datasets(str(tmp_path / "c"), "1,1,0", seq_length, 1, (10, 2, None), cache_dir=cache_dir)

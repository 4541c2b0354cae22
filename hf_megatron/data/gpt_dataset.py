"""GPT pretraining datasets over indexed data: one split of one prefix, and weighted blends."""
from __future__ import annotations

import hashlib
import os

import numpy as np

from ..errors import DataError
from .blending import build_blending_indices, build_exhaustive_blending_indices, normalize
from .cache import cached_arrays, index_problem
from .gpt_indices import build_gpt_indices
from .indexed import IndexedDataset

PAD = -1  # marks tokens past the end of a partial last window (never a real id)


class GPTDataset:
    """Samples of ``seq_length + add_extra_token`` tokens cut from a shuffled stream of documents.

    ``documents`` are the sequence ids of ``indexed`` exposed by this split; ``num_samples=None``
    exposes exactly one epoch.  ``ds[k]`` is an int64 array of the window for shuffled sample
    ``k`` (megatron-core's ``text`` before its input/label split).  The document, sample and
    shuffle indices are megatron-core's (see gpt_indices.py) and cached in ``cache_dir``.
    """

    def __init__(self, indexed: IndexedDataset, documents: np.ndarray, num_samples: int | None,
                 seq_length: int, seed: int, split: str = "train", cache_dir: str | None = None,
                 add_extra_token: bool = True, drop_last_partial: bool = True):
        self.indexed = indexed
        self.seq_length = int(seq_length)
        self.extra = int(bool(add_extra_token))
        self.num_samples = num_samples
        self.split = split
        documents = np.asarray(documents, dtype=np.int32)
        idx_stat = os.stat(indexed.idx_file)
        description = {
            "class": "GPTDataset", "dataset_path": os.path.abspath(indexed.prefix),
            "idx_bytes": idx_stat.st_size, "idx_mtime_ns": idx_stat.st_mtime_ns,
            "documents": [int(documents[0]), int(documents[-1]) + 1] if len(documents) else [0, 0],
            "num_documents": len(documents), "num_samples": num_samples, "split": split,
            "seed": int(seed), "seq_length": self.seq_length, "add_extra_token": self.extra,
            "drop_last_partial": bool(drop_last_partial),
        }
        if not np.array_equal(documents, np.arange(description["documents"][0], description["documents"][1])):
            description["documents_md5"] = hashlib.md5(documents.tobytes()).hexdigest()

        def build():
            tokens = int(indexed.sequence_lengths[documents].sum(dtype=np.int64))
            if tokens <= self.extra:
                raise DataError(f"{indexed.idx_file}: the {split} split has {len(documents)} sequences "
                                 f"and {tokens} tokens, too few for any sample (give it more documents "
                                 "or a larger share in the split string)")
            return build_gpt_indices(indexed.sequence_lengths, documents, num_samples, self.seq_length,
                                     seed, self.extra, drop_last_partial)

        def check(arrays):  # cached arrays must index this dataset (see gpt_indices.py)
            document_index, sample_index, shuffle_index = arrays
            longest = int(indexed.sequence_lengths.max()) if len(indexed) else 0
            problem = index_problem(document_index, 0, len(indexed), (None,))
            if problem:
                return 0, problem
            # an offset is -1 only past an empty last document of a kept partial window
            problem = index_problem(sample_index, -1, max(len(document_index), longest + 1), (None, 2))
            if problem is None:
                for column, what, low, high in ((0, "document-index positions", 0, len(document_index)),
                                                (1, "token offsets", -1, longest + 1)):
                    found = index_problem(sample_index[:, column], low, high, (None,))
                    problem = problem or (found and f"column {column}, {what}: {found}")
            if problem:
                return 1, problem
            problem = index_problem(shuffle_index, 0, len(sample_index) - 1, (len(sample_index) - 1,))
            return (2, problem) if problem else None

        (self.document_index, self.sample_index, self.shuffle_index), self.hash = cached_arrays(
            cache_dir, "GPTDataset", split, description,
            ("document_index", "sample_index", "shuffle_index"), build, check)

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def __getitem__(self, idx: int) -> np.ndarray:
        k = int(self.shuffle_index[idx])
        (first, first_offset), (last, last_offset) = self.sample_index[k], self.sample_index[k + 1]
        first, last = int(first), int(last)
        if first == last:
            parts = [self.indexed.get(int(self.document_index[first]), int(first_offset),
                                      int(last_offset) - int(first_offset) + self.extra)]
        else:
            parts = [self.indexed.get(int(self.document_index[first]), int(first_offset))]
            parts += [self.indexed.get(int(self.document_index[i])) for i in range(first + 1, last)]
            parts.append(self.indexed.get(int(self.document_index[last]), 0, int(last_offset) + self.extra))
        window = np.concatenate(parts).astype(np.int64)
        wanted = self.seq_length + self.extra
        if len(window) < wanted:
            window = np.concatenate([window, np.full(wanted - len(window), PAD, np.int64)])
        return window


class BlendedDataset:
    """Sample ``t`` is sample ``dataset_sample_index[t]`` of ``datasets[dataset_index[t]]``.

    With ``size`` given, weights are normalised and the schedule is megatron's largest-deficit
    one (blending.py); with ``size=None`` the integer ``weights`` are dataset sizes and every
    sample of every dataset is used once.
    """

    def __init__(self, datasets: list[GPTDataset], weights: list[float], size: int | None,
                 split: str = "train", cache_dir: str | None = None):
        if len(datasets) != len(weights):
            raise DataError(f"blend has {len(datasets)} datasets but {len(weights)} weights")
        if any(w <= 0 for w in weights):
            raise DataError(f"blend weights must be positive, got {list(weights)}")
        self.datasets = datasets
        self.weights = normalize(weights) if size is not None else [int(w) for w in weights]
        self.size = size
        description = {"class": "BlendedDataset", "datasets": [d.hash for d in datasets],
                       "weights": self.weights, "size": size, "split": split}

        def build():
            if size is None:
                return build_exhaustive_blending_indices(self.weights)
            dataset_index, sample_index = build_blending_indices(self.weights, size)
            counts = np.bincount(dataset_index, minlength=len(datasets))
            for i, (needed, dataset) in enumerate(zip(counts, datasets)):
                if needed > len(dataset):
                    raise DataError(f"{dataset.indexed.prefix}: the {split} blend needs {needed} samples "
                                     f"from it but it has {len(dataset)} (raise mid_level_surplus)")
            return dataset_index, sample_index

        def check(arrays):  # cached arrays must index these datasets (see blending.py)
            dataset_index, dataset_sample_index = arrays
            length = size if size is not None else sum(self.weights)
            problem = index_problem(dataset_index, 0, len(datasets), (length,))
            if problem:
                return 0, problem
            problem = index_problem(dataset_sample_index, 0, np.iinfo(np.int64).max, (length,))
            past = np.flatnonzero(dataset_sample_index >= np.array([len(d) for d in datasets], np.int64)[
                dataset_index]) if problem is None else ()
            if len(past):
                t, i = int(past[0]), int(dataset_index[past[0]])
                problem = (f"expected sample numbers below each dataset's length, found values {int(dataset_sample_index[t])} "
                           f"at {t} for dataset {i} of {len(datasets[i])} samples")
            return (1, problem) if problem else None

        (self.dataset_index, self.dataset_sample_index), self.hash = cached_arrays(
            cache_dir, "BlendedDataset", split, description, ("dataset_index", "dataset_sample_index"), build,
            check)

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]

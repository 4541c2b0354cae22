"""``build_gpt_datasets``: Megatron's ``--data-path`` / ``--split`` semantics in one call.

Split string "969,30,1" -> fractions ``f = w / sum(w)`` -> book-ends ``[0, f0, f0+f1, 1]``; split
``i`` of a dataset with ``S`` sequences takes sequences ``round(b_i * S) .. round(b_{i+1} * S)``.
A blend ``"w1 p1 w2 p2"`` builds each prefix's splits with ``ceil(ceil(n_i * w_i) * 1.005)``
samples and blends ``sum_i ceil(n_i * w_i)`` of them (megatron-core's surplus rule).
"""
from __future__ import annotations

import math
import os
import re
from itertools import accumulate
from typing import Sequence, Union

import numpy as np

from ..errors import ConfigError, DataError
from .blending import normalize
from .cache import check_output_folder
from .gpt_dataset import BlendedDataset, GPTDataset
from .indexed import IndexedDataset, open_token_dataset
from .sft import build_sft_datasets

SPLITS = ("train", "valid", "test")
Blend = Union[str, Sequence[str], tuple]


def parse_blend(blend: Blend) -> tuple[list[str], list[float] | None]:
    """"prefix" | "w1 p1 w2 p2" | "p1 p2" | ["w1", "p1", ...] | (prefixes, weights) -> (prefixes, weights)."""
    if isinstance(blend, tuple) and len(blend) == 2 and not isinstance(blend[0], str):
        prefixes, weights = list(blend[0]), (None if blend[1] is None else [float(w) for w in blend[1]])
    else:
        items = blend.split() if isinstance(blend, str) else [str(b) for b in blend]
        if not items:
            raise DataError("--data-path / blend is empty: expected 'prefix' or 'w1 prefix1 w2 prefix2 ...'")
        weights = None
        if len(items) % 2 == 0:
            try:
                weights = [float(w) for w in items[0::2]]
                prefixes = items[1::2]
            except ValueError:
                weights = None
        if weights is None:
            prefixes = items
    if weights is not None and len(weights) != len(prefixes):
        raise DataError(f"--data-path blend has {len(prefixes)} prefixes but {len(weights)} weights")
    return [p.strip() for p in prefixes], weights


def split_bookends(split: str) -> list[tuple[float, float] | None]:
    """"969,30,1" -> [(0, .969), (.969, .999), (.999, 1.0)]; a zero share gives None.  Shares are
    plain decimals separated by commas (or slashes): megatron-core's digit-run regex would read
    "-1,2,0" as 1,2,0 and "1e3" as 1 and 3, and fail on "1.2.3"; each is refused here."""
    parts = [part.strip() for part in re.split(r"[,/]", str(split))]
    number = re.compile(r"\d+(\.\d*)?|\.\d+")
    values = [float(part) for part in parts] if all(number.fullmatch(part) for part in parts) else []
    if not values or len(values) > 3 or sum(values) <= 0:
        raise DataError(f"--split {split!r}: expected up to three non-negative numbers like '969,30,1'")
    fractions = normalize(values + [0.0] * (3 - len(values)))
    ends = list(accumulate([0] + fractions))
    return [(ends[i], ends[i + 1]) if ends[i + 1] > ends[i] else None for i in range(3)]


def _open(prefix: str) -> IndexedDataset:
    return open_token_dataset(prefix)


def _splits_of(indexed: IndexedDataset, bookends, sizes, seq_length, seed, cache_dir, extra, drop_valid):
    count = len(indexed)
    out = []
    for name, ends, size in zip(SPLITS, bookends, sizes):
        if ends is None:
            out.append(None)
            continue
        begin, end = int(round(ends[0] * float(count))), int(round(ends[1] * float(count)))
        out.append(GPTDataset(indexed, np.arange(begin, end, dtype=np.int32), size, seq_length, seed,
                              name, cache_dir, add_extra_token=extra,
                              drop_last_partial=drop_valid or name != "valid"))
    return out


def _used_bookends(split: str, skip_splits: Sequence[str]) -> list:
    """split_bookends(split) with the splits named in `skip_splits` set to None (not built)."""
    return [None if name in skip_splits else ends for name, ends in zip(SPLITS, split_bookends(split))]


def build_gpt_datasets(data: Blend, split: str = "969,30,1", seq_length: int = 1024, seed: int = 1234,
                       num_samples: Sequence[int | None] = (None, None, None), cache_dir: str | None = "auto",
                       add_extra_token: bool = True, mid_level_surplus: float = 0.005,
                       drop_last_partial_validation: bool = True, vocab_size: int | None = None,
                       skip_splits: Sequence[str] = ()):
    """(train, valid, test) datasets; a split with a zero share is None.

    ``data``: a prefix, or a blend "w1 prefix1 w2 prefix2" / list / (prefixes, weights).
    ``num_samples``: samples wanted per split (None = one epoch; for a weighted blend None means
    the split is not built).
    ``cache_dir``: where the index .npy files go; "auto" = ``<dir of first prefix>/cache``,
    None = build in memory on every rank.  Under torch.distributed only rank 0 builds.
    ``drop_last_partial_validation=False`` keeps a last, padded, partial validation window
    (megatron's ``drop_last_partial_validation_sequence``).
    ``vocab_size``: when given, every token id must be below it (checked once per file, the result
    kept in ``cache_dir``).
    ``skip_splits``: names ("valid", "test") not built, returned as None (a run that never reads them
    must not fail on them).
    """
    prefixes, weights = parse_blend(data)
    if len(num_samples) != 3 or any(n is not None and (isinstance(n, bool) or not isinstance(n, (int, np.integer))
                                                       or n < 0) for n in num_samples):
        raise ConfigError(f"num_samples: expected (train, valid, test), each None or an integer >= 0, got {num_samples!r}")
    if isinstance(seq_length, bool) or not isinstance(seq_length, (int, np.integer)) or seq_length < 2:
        raise ConfigError(f"seq_length: expected an integer >= 2 (tokens per sample), got {seq_length!r}")
    if cache_dir == "auto":
        cache_dir = os.path.join(os.path.dirname(os.path.abspath(prefixes[0])), "cache")
    if cache_dir is not None:
        check_output_folder("cache_dir", cache_dir)
    bookends = _used_bookends(split, skip_splits)
    extra = bool(add_extra_token)
    indexed = [_open(p) for p in prefixes]
    if vocab_size is not None:
        for ix in indexed:
            ix.check_token_ids(vocab_size, cache_dir)
    for other in indexed[1:]:
        if other.dtype != indexed[0].dtype:
            raise DataError(f"{other.idx_file}: token dtype {other.dtype.name} differs from "
                             f"{indexed[0].idx_file}'s {indexed[0].dtype.name}; blended prefixes must "
                             "come from one tokenizer")
    if len(prefixes) == 1 and weights is None:
        return tuple(_splits_of(indexed[0], bookends, num_samples, seq_length, seed, cache_dir, extra,
                                drop_last_partial_validation))

    if weights is not None:
        weights = normalize(weights)
        # a weighted blend is sized by its sample count: without one the split is not built
        bookends = [ends if n is not None else None for ends, n in zip(bookends, num_samples)]
        if all(ends is None for ends in bookends):
            raise ValueError("a weighted blend is sized by its sample counts: give num_samples for the splits "
                             "to build")
        target = [[math.ceil(n * w) if n is not None else None for n in num_samples] for w in weights]
        buffered = [[int(math.ceil(t * (1 + mid_level_surplus))) if t is not None else None for t in row]
                    for row in target]
    else:
        buffered = [[None] * 3 for _ in prefixes]
    per_prefix = [_splits_of(ix, bookends, sizes, seq_length, seed, cache_dir, extra,
                             drop_last_partial_validation) for ix, sizes in zip(indexed, buffered)]
    result = []
    for i, name in enumerate(SPLITS):
        if bookends[i] is None:
            result.append(None)
            continue
        parts = [splits[i] for splits in per_prefix]
        if weights is not None:
            blend_weights, size = weights, sum(row[i] for row in target)
        else:
            blend_weights = [len(d) for d in parts]
            size = None if num_samples[i] is None else min(num_samples[i], sum(blend_weights))
        result.append(BlendedDataset(parts, blend_weights, size, name, cache_dir))
    return tuple(result)


def build_datasets(run, seed: int, num_samples: Sequence[int | None], vocab_size: int | None = None,
                   skip_splits: Sequence[str] = ()):
    """(train, valid, test) for a run's dataset type: ``run`` is a training RunConfig (read by
    name: data_path, split, seq_length, data_cache_path, sft, sft_pack).  GPT pretraining
    windows by default, SFT response-only windows with ``--sft`` (data/sft.py).  ``vocab_size``:
    token ids must be below it (checked once per file)."""
    if getattr(run, "sft", False):
        if len(run.data_path) != 1 or len(run.data_path[0].split()) != 1:
            raise DataError(f"--sft takes one --data-path prefix (an SFT dataset from `hf-megatron preprocess "
                            f"--sft`), got {run.data_path}; blends are not supported for SFT")
        bookends = _used_bookends(run.split, skip_splits)
        if vocab_size is not None:
            cache_dir = run.data_cache_path or os.path.join(os.path.dirname(os.path.abspath(run.data_path[0])), "cache")
            _open(run.data_path[0]).check_token_ids(vocab_size, cache_dir)
        return build_sft_datasets(run.data_path[0], bookends, run.seq_length, seed, num_samples,
                                  pack=getattr(run, "sft_pack", False))
    return build_gpt_datasets(run.data_path if len(run.data_path) > 1 else run.data_path[0], split=run.split,
                              seq_length=run.seq_length, seed=seed, num_samples=num_samples,
                              cache_dir=run.data_cache_path or "auto", vocab_size=vocab_size, skip_splits=skip_splits)

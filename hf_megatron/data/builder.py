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


BLEND_FORMS = "'prefix [prefix ...]' or 'w1 prefix1 w2 prefix2 ...' (positive blend weights and prefixes alternating)"


def _number(item: str) -> float | None:
    try:
        return float(item)
    except ValueError:
        return None


def _check_blend_items(items: list[str]) -> list[float] | None:
    """The weights of a --data-path list (None: prefixes only) as megatron-core's get_blend_from_list
    reads it -- an even list whose odd places all hold numbers alternates weight, prefix; any other is
    prefixes -- with the lists it misreads refused in one line: a number where a prefix goes (it looks
    for a file named "0.7"), numbers in some weight places only (an AssertionError there), a weight
    that is not a positive number."""
    numbers = [_number(item) for item in items]
    in_weight_places = [number is not None for number in numbers[0::2]] if len(items) % 2 == 0 else []

    def refuse(index: int, problem: str):
        raise ConfigError(f"--data-path {' '.join(items)}: expected {BLEND_FORMS}; item {index + 1} "
                          f"{items[index]!r} {problem}")

    if in_weight_places and all(in_weight_places):
        for k in range(0, len(items), 2):
            if not (math.isfinite(numbers[k]) and numbers[k] > 0):
                refuse(k, "is a weight and not a positive number")
    elif any(in_weight_places):
        refuse(2 * in_weight_places.index(False), f"stands in a weight's place and is not a number (item "
                                                  f"{2 * in_weight_places.index(True) + 1} is one)")
    hint = ("" if any(in_weight_places) else " (a weight comes before its prefix)" if in_weight_places
            else " (an odd count of items: a weight without its prefix?)")
    for k, number in enumerate(numbers):
        if number is not None and (k % 2 or not any(in_weight_places)):
            refuse(k, "is a number where a prefix goes" + hint)
    return numbers[0::2] if any(in_weight_places) else None


def parse_blend(blend: Blend) -> tuple[list[str], list[float] | None]:
    """"prefix" | "w1 p1 w2 p2" | "p1 p2" | ["w1", "p1", ...] | (prefixes, weights) -> (prefixes, weights);
    a list megatron-core's get_blend_from_list reads gives what it gives, one it would read wrong is
    refused in one line (_check_blend_items)."""
    if isinstance(blend, tuple) and len(blend) == 2 and not isinstance(blend[0], str):
        prefixes, weights = list(blend[0]), (None if blend[1] is None else [float(w) for w in blend[1]])
        if weights is not None and len(weights) != len(prefixes):
            raise ConfigError(f"blend has {len(prefixes)} prefixes but {len(weights)} weights")
        if weights is not None and not all(math.isfinite(w) and w > 0 for w in weights):
            raise ConfigError(f"blend weights {weights}: expected positive numbers")
        return [str(p).strip() for p in prefixes], weights
    items = blend.split() if isinstance(blend, str) else [str(b).strip() for b in blend]
    if not items:
        raise ConfigError(f"--data-path is empty: expected {BLEND_FORMS}")
    weights = _check_blend_items(items)
    return (items[1::2] if weights is not None else items), weights


def parse_data_path(data_path: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """parse_blend of a --data-path list; one item is split at whitespace (a config file's
    "w1 p1 w2 p2" string, or a quoted one)."""
    return parse_blend(data_path[0] if len(data_path) == 1 else data_path)


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

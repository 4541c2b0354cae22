"""The three arrays behind a Megatron GPT dataset, computed exactly as megatron-core 0.16 does.

Notation: the split exposes documents ``d_0 .. d_{N-1}`` with lengths ``L``; one epoch has
``T = sum(L)`` tokens.  A sample is a window of ``s + x`` tokens (``s`` = sequence length,
``x`` = 1 extra token so that inputs and shifted targets are both ``s`` long); consecutive
samples start ``s`` tokens apart, so they overlap by ``x`` tokens.

* epochs ``E`` = smallest E >= 1 with ``E*T >= num_samples*s + x``;
* document index: the document ids repeated ``E`` times and shuffled by
  ``numpy.random.RandomState(seed)``; when the last epoch would contribute fewer than 80% of an
  epoch's samples it is shuffled separately (so early samples never see its documents twice);
* sample index ``[n+1, 2]``: row ``k`` = (position in the document index, token offset) where
  sample ``k`` starts in the concatenated stream; sample ``k`` starts at stream position ``k*s``;
* shuffle index: a permutation of ``range(n)`` (the separate final epoch permuted on its own).

The sample index is vectorised: with cumulative document ends ``C``, the row for stream position
``p`` is ``j = #{i : C_i <= p + x - 1}`` (the document holding the last token of the previous
window; empty documents are skipped), found for all samples at once from a histogram of
``ceil((C_i - x + 1) / s)``, and offset ``p - C_{j-1}``; linear in documents + samples.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import DataError

SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


def num_epochs_needed(tokens_per_epoch: int, num_samples: int | None, seq_length: int, extra: int) -> int:
    """Smallest E >= 1 with E * tokens_per_epoch >= num_samples * seq_length + extra."""
    if num_samples is None:
        return 1
    if tokens_per_epoch <= 0:
        raise DataError(f"the split has no tokens but {num_samples} samples were requested "
                         "(give it more documents or a larger share in the split string)")
    requested = num_samples * seq_length + extra
    return max(1, -(-requested // tokens_per_epoch))


def separate_final_epoch(num_epochs: int, tokens_per_epoch: int, num_samples: int,
                         seq_length: int, extra: int) -> tuple[bool, int]:
    """(whether the last epoch is shuffled on its own, samples before the last epoch)."""
    if num_epochs == 1:
        return False, 0
    before_final = ((num_epochs - 1) * tokens_per_epoch - extra) // seq_length
    from_final = num_samples - before_final
    per_epoch = (tokens_per_epoch - extra) // seq_length
    if not 0 <= from_final <= per_epoch + 1:
        raise ValueError(f"inconsistent epoch arithmetic: {from_final} samples from the final epoch, "
                         f"{per_epoch} per epoch")
    return from_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch), before_final


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final: bool) -> np.ndarray:
    """``documents`` tiled ``num_epochs`` times, int32, shuffled in place by ``rng``."""
    documents = np.asarray(documents, dtype=np.int32)
    if separate_final and num_epochs > 1:
        first = build_document_index(documents, num_epochs - 1, rng, False)
        last = build_document_index(documents, 1, rng, False)
        return np.concatenate((first, last))
    index = np.tile(documents, num_epochs)
    rng.shuffle(index)
    return index


def num_samples_in_stream(total_tokens: int, seq_length: int, extra: int, drop_last_partial: bool) -> int:
    if drop_last_partial:
        return (total_tokens - extra) // seq_length
    # megatron-core divides in single precision here; reproduce it so the counts agree
    return int(math.ceil(np.float32(total_tokens - extra) / np.float32(seq_length)))


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int,
                       num_epochs: int, tokens_per_epoch: int, drop_last_partial: bool = True,
                       extra: int = 1) -> np.ndarray:
    """Start (document-index position, offset) of every sample plus the end of the last one."""
    if seq_length < 2:
        raise ValueError(f"sequence length must be >= 2, got {seq_length}")
    n = num_samples_in_stream(num_epochs * tokens_per_epoch, seq_length, extra, drop_last_partial)
    # gathers from an in-memory copy are several times faster than from the mapped .idx pages,
    # and an in-place int64 cumsum beats cumsum(dtype=int64) on int32 input
    sizes = np.array(sizes) if len(document_index) * 2 > len(sizes) else np.asarray(sizes)
    doc_ends = sizes[document_index].astype(np.int64)
    np.cumsum(doc_ends, out=doc_ends)
    total = int(doc_ends[-1]) if len(doc_ends) else 0
    wide = max(len(document_index), int(sizes.max()) if len(sizes) else 0) > np.iinfo(np.int32).max
    out = np.empty((n + 1, 2), dtype=np.int64 if wide else np.int32)
    out[0] = (0, 0)
    # sample k >= 1 starts at p_k = k*s; its row is the document holding q_k = p_k + x - 1.
    # Windows with q_k inside the stream are the first `inside` ones (q_k grows with k).
    inside = min(n, max(total - extra, -1) // seq_length)
    # j_k = #{documents j : end_j <= q_k}; end_j <= q_k  <=>  k >= m_j := ceil((end_j - x + 1) / s),
    # so j_k is a prefix sum of the histogram of m_j (m_j >= 0): linear time, no binary search
    first_k = doc_ends + (seq_length - extra)
    first_k //= seq_length
    position = np.cumsum(np.bincount(first_k, minlength=inside + 2)[:inside + 1])[1:]
    starts = np.arange(1, inside + 1, dtype=np.int64) * seq_length
    out[1:inside + 1, 0] = position
    out[1:inside + 1, 1] = starts - (doc_ends[position] - sizes[document_index[position]])
    # a partial last window (drop_last_partial=False) ends the stream like megatron-core's loop
    if inside < n:
        out[inside + 1:, 0] = len(document_index) - 1
        out[inside + 1:, 1] = int(sizes[document_index[-1]]) - extra
    return out


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """Permutation of ``range(num_samples)`` followed by one of ``range(num_samples, total_size)``."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_gpt_indices(sizes: np.ndarray, documents: np.ndarray, num_samples: int | None,
                      seq_length: int, seed: int, extra: int = 1,
                      drop_last_partial: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document_index, sample_index, shuffle_index) for the documents ``documents`` of a dataset
    whose sequence lengths are ``sizes``; ``num_samples=None`` means one epoch."""
    sizes = np.asarray(sizes)
    tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
    epochs = num_epochs_needed(tokens_per_epoch, num_samples, seq_length, extra)
    separate, before_final = (separate_final_epoch(epochs, tokens_per_epoch, num_samples, seq_length, extra)
                              if num_samples is not None else (False, 0))
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, epochs, rng, separate)
    sample_index = build_sample_index(sizes, document_index, seq_length, epochs, tokens_per_epoch,
                                      drop_last_partial, extra)
    total = sample_index.shape[0] - 1
    shuffle_index = build_shuffle_index(before_final if separate else total, total, rng)
    return document_index, sample_index, shuffle_index

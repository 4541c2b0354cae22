"""SFT datasets: prompt/response documents in windows of ``seq_length + 1`` tokens, response-only targets.

Input: an SFT token dataset ``P`` (``hf-megatron preprocess --sft``) and its loss mask
``P_loss_mask`` (uint8, same documents and sequence lengths; 1 = response token).  A sample is
one document (a prompt/response pair or a whole chat).  Each window ``w`` of ``s + 1`` tokens
with mask ``m`` gives

    input_ids[t] = w[t]                                   t = 0 .. s-1
    targets[t]   = w[t+1]  if m[t+1] == 1  else  -100     (-100: not scored, model/gpt.py)

so the loss is the mean over response tokens only, and validation loss is response-only too.

Two layouts (``train --sft`` / ``train --sft --sft-pack``):

* pad (default): one document per window, truncated to ``s + 1`` tokens, right-padded (input
  id 0, target -100).  With causal attention the padding never reaches a real token, so each
  sample's loss is exactly transformers' loss on that sample alone with labels -100 on the prompt.
* pack: documents are laid end to end, greedily, into windows (a document that does not fit
  in the rest of a window starts the next one; one longer than a window is truncated).  Fewer
  padded tokens, but tokens attend to earlier documents of their window (no per-document
  attention mask, as in pretraining).  The first token of every document is never a target,
  so nothing is scored for predicting a document from the one before it.

Order: every epoch is a fresh permutation of this split's documents (``RandomState(seed + e)``);
epochs are added until ``num_samples`` windows exist (``None``: one epoch).  The indices are a
few numpy arrays built in memory on every rank (no cache files).
"""
from __future__ import annotations

import os

import numpy as np
import torch

from ..errors import DataError, DataNotFoundError
from .indexed import IndexedDataset, idx_path, open_token_dataset
from .sft_records import loss_mask_prefix

IGNORE = -100  # model/gpt.py IGNORE_INDEX (data/ sits below model/ in no import order; same value)


def open_sft_prefix(prefix: str) -> tuple[IndexedDataset, IndexedDataset]:
    """The token dataset and its loss mask, checked to describe the same documents."""
    mask_prefix = loss_mask_prefix(prefix)
    if not os.path.isfile(idx_path(mask_prefix)):
        raise DataNotFoundError(f"{idx_path(mask_prefix)}: --sft needs the loss mask written by "
                                f"`hf-megatron preprocess --sft` beside {prefix}.bin/.idx")
    tokens, mask = open_token_dataset(prefix), IndexedDataset(mask_prefix)
    if not (np.array_equal(tokens.sequence_lengths, mask.sequence_lengths)
            and np.array_equal(tokens.document_indices, mask.document_indices)):
        raise DataError(f"{mask.idx_file}: loss mask does not match {tokens.idx_file} (different documents "
                        "or sequence lengths); preprocess them together")
    if mask.dtype != np.uint8:
        raise DataError(f"{mask.idx_file}: loss mask dtype {mask.dtype.name}, expected uint8")
    return tokens, mask


def pack_windows(lengths: np.ndarray, window: int) -> np.ndarray:
    """Greedy packing: start positions (into ``lengths``) of each window, plus the end.

    Documents go in order; a document joins the current window while the window's total stays
    <= ``window`` (lengths are already clipped to ``window``)."""
    starts, used = [0], 0
    for i, length in enumerate(lengths.tolist()):
        if used + length > window and used:
            starts.append(i)
            used = 0
        used += length
    starts.append(len(lengths))
    return np.asarray(starts, np.int64)


class SFTDataset:
    """``ds[k]`` = {"input_ids": int64[s], "targets": int64[s]} for window ``k`` (module docstring)."""

    def __init__(self, tokens: IndexedDataset, mask: IndexedDataset, documents: np.ndarray,
                 num_samples: int | None, seq_length: int, seed: int, pack: bool = False, split: str = "train"):
        self.tokens, self.mask = tokens, mask
        self.seq_length, self.pack, self.split = int(seq_length), bool(pack), split
        documents = np.asarray(documents, np.int64)
        if not len(documents):
            raise DataError(f"{tokens.idx_file}: the {split} split has no documents (give it a larger share "
                            "in --split or more data)")
        window = self.seq_length + 1
        ends = tokens.document_indices
        cumulative = np.concatenate([[0], np.cumsum(tokens.sequence_lengths, dtype=np.int64)])
        doc_tokens = cumulative[ends[documents + 1]] - cumulative[ends[documents]]
        clipped = np.minimum(doc_tokens, window)
        order, starts, epoch, count = [], [np.zeros(1, np.int64)], 0, 0
        while True:
            positions = np.random.RandomState(seed + epoch).permutation(len(documents))
            if self.pack:
                bounds = pack_windows(clipped[positions], window)
            else:
                bounds = np.arange(len(positions) + 1, dtype=np.int64)
            starts.append(bounds[1:] + len(documents) * epoch)  # into the concatenated epoch orders
            order.append(documents[positions])
            count += len(bounds) - 1
            epoch += 1
            if num_samples is None or count >= num_samples:
                break
        self.document_order = np.concatenate(order)
        self.window_starts = np.concatenate(starts)
        self.num_samples = count if num_samples is None else int(num_samples)

    def __len__(self) -> int:
        return self.num_samples

    def _document(self, doc: int) -> tuple[np.ndarray, np.ndarray]:
        window = self.seq_length + 1
        return self.tokens.document(doc)[:window], self.mask.document(doc)[:window]

    def __getitem__(self, k: int) -> dict[str, np.ndarray]:
        if not 0 <= k < self.num_samples:
            raise IndexError(f"SFT sample {k} outside [0, {self.num_samples})")
        window = self.seq_length + 1
        ids, scored = np.zeros(window, np.int64), np.zeros(window, bool)
        used = 0
        for doc in self.document_order[self.window_starts[k]:self.window_starts[k + 1]]:
            tokens, mask = self._document(int(doc))
            ids[used:used + len(tokens)] = tokens
            scored[used:used + len(tokens)] = mask.astype(bool)
            if len(tokens):
                scored[used] = False  # a document's first token is never a target
            used += len(tokens)
        targets = np.where(scored[1:], ids[1:], IGNORE)
        return {"input_ids": ids[:-1], "targets": targets}

    @staticmethod
    def collate(samples: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
        return {key: torch.from_numpy(np.stack([s[key] for s in samples])) for key in samples[0]}


def build_sft_datasets(prefix: str, bookends, seq_length: int, seed: int, num_samples, pack: bool):
    """(train, valid, test) SFTDatasets over document ranges ``round(b_i * D) .. round(b_{i+1} * D)``
    (``bookends`` from builder.split_bookends; None entries give None)."""
    tokens, mask = open_sft_prefix(prefix)
    count = tokens.num_documents
    out = []
    for name, ends, size in zip(("train", "valid", "test"), bookends, num_samples):
        if ends is None:
            out.append(None)
            continue
        begin, end = int(round(ends[0] * float(count))), int(round(ends[1] * float(count)))
        if begin == end and size is None:  # an empty split nobody asks samples of (test, valid without eval)
            out.append(None)
            continue
        out.append(SFTDataset(tokens, mask, np.arange(begin, end), size, seq_length, seed + 1000 * len(out),
                              pack, name))
    return tuple(out)

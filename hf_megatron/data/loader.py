"""Megatron-style batching: global batches sliced per data-parallel rank and per micro batch.

Global sample order is the dataset order ``consumed, consumed+1, ...``.  Every step of
``micro_batch_size * dp_size`` consecutive samples is one "micro step" across all ranks; rank ``r``
takes the slice ``[r*mbs, (r+1)*mbs)`` of it (MegatronPretrainingSampler).  Resuming from
``consumed_samples`` (the number of samples all ranks together have consumed) continues the same
sequence, so a restarted run sees exactly the batches the uninterrupted one would have seen.

Token windows and the HF shift: a Megatron sample is ``seq_length + 1`` tokens ``w``; Megatron
trains on inputs ``w[:-1]`` against targets ``w[1:]``.  Our GPTModel follows transformers and
shifts internally (logits at position ``t`` are scored against ``labels[t+1]``), so we yield
``input_ids = labels = w`` (all ``seq_length + 1`` tokens).  The model then scores exactly
Megatron's ``seq_length`` targets per sample and every corpus token is a target once per epoch;
the last position's logits are unused (one extra position of compute).  The length seen by the
model is therefore ``seq_length + 1``: with sequence/context parallelism pick ``seq_length`` so that
``seq_length + 1`` divides evenly, or build the datasets with ``add_extra_token=False`` (windows
of exactly ``seq_length`` tokens, Megatron's ``add_extra_token_to_sequence=False``; the model then
scores ``seq_length - 1`` targets per sample).  Padding past the end of a partial window has
input id 0 and label -100 (ignored by the loss).
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from .gpt_dataset import PAD


class MegatronPretrainingSampler:
    """Yields lists of dataset indices: this rank's micro batch of each global micro step."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, drop_last: bool = True):
        if total_samples <= 0:
            raise ValueError(f"no samples to iterate (total_samples={total_samples})")
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(f"consumed_samples={consumed_samples} outside [0, {total_samples}]")
        if micro_batch_size <= 0 or dp_size <= 0 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need micro_batch_size > 0 and 0 <= dp_rank < dp_size, got "
                             f"{micro_batch_size}, {dp_rank}, {dp_size}")
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        step = self.micro_batch_size * self.dp_size
        remaining = self.total_samples - self.consumed_samples
        return remaining // step + (0 if self.drop_last or remaining % step == 0 else 1)

    def __iter__(self) -> Iterator[list[int]]:
        step = self.micro_batch_size * self.dp_size
        begin = self.dp_rank * self.micro_batch_size
        for start in range(self.consumed_samples, self.total_samples, step):
            end = min(start + step, self.total_samples)
            if end - start < step and self.drop_last:
                return
            # a short last step still gives each rank its own slice (maybe empty)
            mine = list(range(start + begin, min(start + begin + self.micro_batch_size, end)))
            if mine:
                yield mine


def collate_windows(windows: list[np.ndarray]) -> dict[str, torch.Tensor]:
    """Stack token windows into {"input_ids", "labels"} (see the module docstring)."""
    tokens = torch.from_numpy(np.stack(windows))
    pad = tokens == PAD
    return {"input_ids": tokens.masked_fill(pad, 0), "labels": tokens.masked_fill(pad, -100)}


def batch_iterator(dataset, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                   consumed_samples: int = 0, num_workers: int = 0, drop_last: bool = True
                   ) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's micro batches {"input_ids": LongTensor[b, L], "labels": LongTensor[b, L]} with
    ``L = seq_length + 1`` (labels == input_ids; the model shifts), starting after
    ``consumed_samples`` global samples.  ``num_workers > 0`` reads in DataLoader workers."""
    sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                         dp_rank, dp_size, drop_last)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                         collate_fn=collate_windows, pin_memory=False,
                                         persistent_workers=False)
    return iter(loader)

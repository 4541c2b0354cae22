"""Megatron-style batching: global batches sliced per data-parallel rank and per micro batch.

Global sample order is the dataset order ``consumed, consumed+1, ...``.  Every step of
``micro_batch_size * dp_size`` consecutive samples is one "micro step" across all ranks; rank ``r``
takes the slice ``[r*mbs, (r+1)*mbs)`` of it (MegatronPretrainingSampler).  Resuming from
``consumed_samples`` (the number of samples all ranks together have consumed) continues the same
sequence, so a restarted run sees exactly the batches the uninterrupted one would have seen.

Token windows and the shift: a Megatron sample is a window ``w`` of ``seq_length + 1`` tokens;
it trains on inputs ``w[:-1]`` against targets ``w[1:]``.  The shift happens here, once: we yield
``input_ids = w[:-1]`` and aligned ``targets = w[1:]`` (the model scores token t against
targets[t]), so a sample scores exactly ``seq_length`` targets and the model sees ``seq_length``
positions (divisible as sequence parallelism wants).  With ``add_extra_token=False`` datasets
(windows of exactly ``seq_length`` tokens, Megatron's ``add_extra_token_to_sequence=False``) the
inputs are the whole window and the last target is -100, as megatron-core's loss mask has it.
Padding past the end of a partial window has input id 0 and target -100 (not scored).
"""
from __future__ import annotations

import functools
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


def collate_windows(windows: list[np.ndarray], extra_token: bool = True) -> dict[str, torch.Tensor]:
    """Stack token windows into aligned {"input_ids", "targets"} (see the module docstring)."""
    tokens = torch.from_numpy(np.stack(windows))
    pad = tokens == PAD
    ids, targets = tokens.masked_fill(pad, 0), tokens.masked_fill(pad, -100)
    if extra_token:
        return {"input_ids": ids[:, :-1], "targets": targets[:, 1:]}
    return {"input_ids": ids, "targets": torch.cat([targets[:, 1:], targets.new_full((len(windows), 1), -100)], 1)}


def _extra_token(dataset) -> bool:
    """Whether the dataset's windows hold seq_length + 1 tokens (a blend: its parts')."""
    parts = getattr(dataset, "datasets", None)
    return bool(getattr(parts[0] if parts else dataset, "extra", 1))


def batch_iterator(dataset, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                   consumed_samples: int = 0, num_workers: int = 0, drop_last: bool = True
                   ) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's micro batches {"input_ids": LongTensor[b, s], "targets": LongTensor[b, s]}
    (``s = seq_length``, targets aligned), starting after ``consumed_samples`` global samples.
    ``num_workers > 0`` reads in DataLoader workers."""
    sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                         dp_rank, dp_size, drop_last)
    # datasets that cut their own inputs/targets (data/sft.py) bring their collate
    collate = getattr(dataset, "collate", None) or functools.partial(collate_windows, extra_token=_extra_token(dataset))
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                         collate_fn=collate, pin_memory=False, persistent_workers=False)
    return iter(loader)

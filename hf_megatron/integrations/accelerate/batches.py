"""A transformers-style batch -> equal-shaped micro batches for the engine.

    batch: input_ids [b, s], optional labels (transformers' meaning: the model shifts; -100 = not
           scored; default input_ids with attention_mask == 0 positions unscored),
           attention_mask [b, s], position_ids [b, s] or [1, s]
    ->     ceil(b / m) micro batches of m samples, {input_ids, targets (aligned), ...}

The pipeline schedules want every micro batch of one shape, so a remainder (an eval batch of
any size, the short last batch of an epoch) is padded with copies of the first sample whose
targets are all -100: they add nothing to the loss sum, the token count or the gradients, so
the result is that of the real samples alone.  `multiple_of` pads whole micro batches the same
way (the interleaved schedule needs a multiple of the pipeline size).

Sequence parallelism cuts the sequence into tp equal slices, so a length s that is not a multiple
of tp (dynamic padding: any s) is padded at the end to s' = ceil(s / tp) * tp: targets -100,
attention_mask 0 where the batch has one, position_ids (given or 0..s-1) repeating the last real
position (no longer position table, no other RoPE scaling branch), token 0.  Causal attention never
lets a real position see a later one, so the loss, its token count and the gradients are those
of the unpadded batch; logits of the padded positions are dropped by the caller.
"""
from __future__ import annotations

import math

import torch

from ...errors import ConfigError
from ...model.gpt import shift_labels

IGNORE = -100
KNOWN_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")


def _targets(batch: dict) -> torch.Tensor:
    labels = batch.get("labels")
    if labels is None:
        labels = batch["input_ids"].clone()
        if batch.get("attention_mask") is not None:
            labels = labels.masked_fill(batch["attention_mask"] == 0, IGNORE)
    return shift_labels(labels)  # transformers' labels -> aligned targets, once


def check_batch(batch: dict) -> dict[str, torch.Tensor]:
    """The batch's tensors, with one-line errors for what the engine cannot take."""
    if not isinstance(batch.get("input_ids"), torch.Tensor) or batch["input_ids"].ndim != 2:
        raise ConfigError("model(**batch) (Megatron-LM engine): expected an 'input_ids' tensor [batch, seq], got "
                          f"{type(batch.get('input_ids')).__name__}")
    unknown = sorted(k for k, v in batch.items() if k not in KNOWN_KEYS and v is not None)
    if unknown:
        raise ConfigError(f"model(**batch) (Megatron-LM engine): unsupported input(s) {unknown}; expected "
                          f"{', '.join(KNOWN_KEYS)}")
    return {k: v for k, v in batch.items() if v is not None}


def _pad_sequence(parts: dict[str, torch.Tensor], seq_multiple: int) -> dict[str, torch.Tensor]:
    """Pad the sequence dimension to a multiple of `seq_multiple` (module docstring)."""
    size, seq = parts["input_ids"].shape
    pad = -seq % seq_multiple
    if not pad:
        return parts
    if "position_ids" not in parts:
        parts["position_ids"] = torch.arange(seq, device=parts["input_ids"].device).expand(size, seq)
    fill = {"input_ids": 0, "targets": IGNORE, "attention_mask": 0}
    out = {}
    for key, value in parts.items():
        if key == "position_ids":
            filler = value[:, -1:].expand(size, pad)
        else:
            filler = value.new_full((size, pad), fill[key])
        out[key] = torch.cat([value, filler], dim=1)
    return out


def micro_batches(batch: dict, micro_batch_size: int, multiple_of: int = 1,
                  seq_multiple: int = 1) -> list[dict[str, torch.Tensor]]:
    batch = check_batch(batch)
    size, seq = batch["input_ids"].shape
    parts = {"input_ids": batch["input_ids"], "targets": _targets(batch)}
    for key in ("attention_mask", "position_ids"):
        if key in batch:
            parts[key] = batch[key].expand(size, seq)
    parts = _pad_sequence(parts, seq_multiple)
    seq = parts["input_ids"].shape[1]
    count = math.ceil(size / micro_batch_size)
    count = math.ceil(count / multiple_of) * multiple_of
    pad = count * micro_batch_size - size
    if pad:
        for key, value in parts.items():
            filler = value[:1].expand(pad, seq)
            parts[key] = torch.cat([value, torch.full_like(filler, IGNORE) if key == "targets" else filler])
    split = {key: value.split(micro_batch_size) for key, value in parts.items()}
    return [{key: chunks[i] for key, chunks in split.items()} for i in range(count)]

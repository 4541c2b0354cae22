"""`--verify`: read every converted tensor back and compare it with the source's, then run the
source and the converted model on a fixed prompt and compare logits.

The tensor check is exact (the conversions only split, merge and permute): the written files are
read back, mapped back to the source's names by the inverse mapping (reshard: none needed), and
every tensor must equal the source's in the output's dtype.  It sees what a short prompt cannot --
an embedding row the prompt never looks up, a position past it.  The logits check covers the
meaning of the layout (a mapping and its inverse wrong in the same way would read back equal).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from ..errors import CheckpointError
from ..model.gpt import GPTModel
from ..parallel.sharding import load_full_weights

PROMPT_LEN = 16
DEFAULT_TOL = 1e-4


class VerifyError(CheckpointError):
    """Converted logits differ from the source's: the conversion is wrong and its output is not written."""


@dataclass
class VerifyResult:
    max_abs_diff: float
    top1_agreement: float
    tensors: int = 0  # tensors compared exactly before the logits

    def __str__(self) -> str:
        checked = f"{self.tensors} tensors equal, " if self.tensors else ""
        return f"verify: {checked}max abs logit diff {self.max_abs_diff:.3g}, top-1 agreement {self.top1_agreement:.1%}"


def fixed_prompt(vocab_size: int, max_positions: int) -> torch.Tensor:
    length = min(PROMPT_LEN, max_positions)
    return torch.tensor([[(7919 * i + 13) % vocab_size for i in range(length)]])


def _round(model: torch.nn.Module, dtype: torch.dtype | None) -> torch.nn.Module:
    if dtype is not None and dtype != torch.float32:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(dtype).float())
    return model


@torch.no_grad()
def hf_logits(folder: str | Path, ids: torch.Tensor, round_to: torch.dtype | None = None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # keep the CLI's output to our one-line report
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager")
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    return _round(model.eval(), round_to)(input_ids=ids).logits.float()


@torch.no_grad()
def megatron_logits(checkpoint, ids: torch.Tensor, round_to: torch.dtype | None = None) -> torch.Tensor:
    """Logits of our single-process GPTModel holding a Megatron checkpoint's merged weights."""
    model = GPTModel(checkpoint.config, dtype=torch.float32)  # plain: no process group involved
    load_full_weights(model, checkpoint.full_state_dict().items())  # copy_ casts to fp32
    return _round(model.eval(), round_to)(ids).logits.float()


def compare(source: torch.Tensor, converted: torch.Tensor, tol: float = DEFAULT_TOL, tensors: int = 0) -> VerifyResult:
    if source.shape != converted.shape:
        raise VerifyError(f"verify: logits shapes differ: source {tuple(source.shape)}, converted {tuple(converted.shape)}")
    diff = (source - converted).abs().max().item()
    top1 = (source.argmax(-1) == converted.argmax(-1)).float().mean().item()
    result = VerifyResult(diff, top1, tensors)
    bound = tol * max(1.0, source.abs().max().item())
    if not diff <= bound:  # also catches NaN
        raise VerifyError(f"{result}: exceeds tolerance {bound:.3g}; the conversion is wrong, output not written")
    return result


def compare_tensors(pairs: Iterable[tuple[str, torch.Tensor]], get_other: Callable[[str], torch.Tensor],
                    dtype: torch.dtype | None = None) -> int:
    """Every (name, tensor) of one side equals `get_other(name)` (cast to `dtype` first when given):
    same shape, same dtype, same values.  Returns how many were compared."""
    count = 0
    for name, mine in pairs:
        other = get_other(name)
        if dtype is not None and other.is_floating_point():
            other = other.to(dtype)
        if mine.shape != other.shape or mine.dtype != other.dtype:
            raise VerifyError(f"verify: tensor {name}: {tuple(mine.shape)} {mine.dtype} against {tuple(other.shape)} "
                              f"{other.dtype}; the conversion is wrong, output not written")
        if not torch.equal(mine, other):
            diff = (mine.float() - other.float()).abs()
            where = tuple(int(i) for i in torch.nonzero(diff == diff.max())[0]) if diff.numel() else ()
            raise VerifyError(f"verify: tensor {name} differs from the source (max abs diff {diff.max().item():.3g} "
                              f"at {where}); the conversion is wrong, output not written")
        count += 1
    return count

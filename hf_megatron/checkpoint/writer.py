"""Megatron rank files: the one builder of `model_optim_rng.pt`, and writing full tensors at any
TP / PP / virtual-PP layout.

A rank file (Megatron-LM's fields):

    model | model0, model1, ...   stage-local state dict of each model chunk
    args                         argparse.Namespace (`args.build_args`)
    checkpoint_version           3.0
    iteration                    int (0 for a release checkpoint)
    rng_state, optimizer, opt_param_scheduler, ...   when the caller has them (training)

Model chunk c = v * pp + p (chunk v of stage p) holds the layers `stage_layers(L, pp * vpp, c)`,
renumbered from 0 in its file.  The first chunk owns the embedding; the last owns the final
norm and output layer -- for tied embeddings too when it lacks the embedding (Megatron keeps a
copy there).  `write_megatron` writes one rank at a time: memory is one rank's shard plus one
full tensor (the source is asked again for every rank; sources are lazy readers).
`legacy_names` writes each chunk in Megatron-LM's pre-mcore nested layout (legacy.mcore_to_legacy).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from ..errors import ParallelConfigError
from ..parallel.sharding import split_tensor, stage_layers
from .args import build_args
from .files import MODEL_FILE, rank_dir_name, save_atomic
from .legacy import mcore_to_legacy
from .names import LAYER, model_keys

CHECKPOINT_VERSION = 3.0
# source(layers) -> (full name, full tensor) for those layers + embedding, final norm, output layer
Source = Callable[[Iterable[int]], Iterator[tuple[str, torch.Tensor]]]


def rank_payload(model_states: list[dict], args: argparse.Namespace, iteration: int | str,
                 extra: dict[str, Any] | None = None, **state: Any) -> dict[str, Any]:
    """The contents of one rank's model_optim_rng.pt.  `state`: optimizer, opt_param_scheduler,
    rng_state, ... (entries given as None are left out); `extra` entries go in as they are."""
    payload: dict[str, Any] = dict(zip(model_keys(len(model_states)), model_states))
    payload.update(args=args, checkpoint_version=CHECKPOINT_VERSION, iteration=0 if iteration == "release" else iteration)
    payload.update({k: v for k, v in state.items() if v is not None})
    payload.update(extra or {})
    return payload


def write_rank_file(rank_dir: Path, payload: dict[str, Any]) -> Path:
    rank_dir.mkdir(parents=True, exist_ok=True)
    save_atomic(payload, rank_dir / MODEL_FILE)
    return rank_dir / MODEL_FILE


def params_dtype(states: Iterable[dict[str, torch.Tensor]]) -> torch.dtype:
    """The dtype of the first floating-point tensor of some state dicts (fp32 if none)."""
    return next((t.dtype for state in states for t in state.values()
                 if isinstance(t, torch.Tensor) and t.is_floating_point()), torch.float32)


def check_layout(config, tp: int, pp: int, vpp: int | None) -> None:
    for name, value in (("tp", tp), ("pp", pp), ("vpp", vpp)):
        if value is not None and value < 1:
            raise ParallelConfigError(f"--{name} (tensor / pipeline / virtual pipeline size): expected >= 1, got {value}")
    if vpp and vpp > 1 and pp == 1:
        raise ParallelConfigError("--vpp needs --pp > 1 (virtual stages interleave pipeline stages)")
    chunks = pp * (vpp or 1)
    for what, value in (("num_attention_heads", config.num_attention_heads),
                        ("num_query_groups (num_key_value_heads)", config.num_query_groups),
                        ("ffn_hidden_size", config.ffn_hidden_size)):
        if value % tp:
            raise ParallelConfigError(f"{what}={value} is not divisible by tp={tp}")
    if config.num_layers % chunks:
        raise ParallelConfigError(f"num_layers={config.num_layers} is not divisible by pp x vpp = {chunks}")


def chunk_layers(config, pp: int, vpp: int, stage: int, chunk: int) -> range:
    """Global layers of virtual chunk `chunk` on pipeline stage `stage` (model chunk chunk * pp + stage)."""
    return stage_layers(config.num_layers, pp * vpp, chunk * pp + stage)


def chunk_state(source: Source, config, tp: int, tp_rank: int, layers: range,
                pre: bool, post: bool) -> dict[str, torch.Tensor]:
    """The stage-local, TP-sharded state dict of one model chunk."""
    tied = config.tie_word_embeddings
    state: dict[str, torch.Tensor] = {}
    for name, tensor in source(layers):
        match = LAYER.match(name)
        if match:
            index = int(match.group(1))
            if index not in layers:
                continue
            local = f"decoder.layers.{index - layers.start}.{match.group(2)}"
        elif name.startswith("embedding."):
            local = name if pre else None
            if name == "embedding.word_embeddings.weight" and tied and post and not pre:
                local = "output_layer.weight"
        elif name.startswith("decoder.final_layernorm."):
            local = name if post else None
        elif name == "output_layer.weight":
            local = name if post and not tied else None
        else:
            raise ValueError(f"unexpected tensor {name!r} from the source")
        if local is None:
            continue
        # clone: a chunk is a view, and torch.save would write the whole full tensor's storage
        state[local] = split_tensor(name, tensor, config, tp)[tp_rank].clone()
    return state


def write_megatron(iter_dir: Path, config, source: Source, tp: int, pp: int, vpp: int | None = None,
                   iteration: int | str = "release", args: dict | None = None, extra: dict | None = None,
                   legacy_names: bool = False, rank_extra: Callable[[int, int], dict] | None = None) -> None:
    """Write every rank's model_optim_rng.pt under `iter_dir` (no tracker file: caller's job).
    `legacy_names`: model entries in the nested `language_model.*` layout (legacy.mcore_to_legacy).
    `rank_extra(tp_rank, stage)`: entries of that rank's file only (e.g. its optimizer entry)."""
    if legacy_names:
        if config.qk_layernorm:
            raise ParallelConfigError("--legacy-names: legacy Megatron models have no q/k layernorm (Qwen3)")
        args = {"use_legacy_models": True, **(args or {})}
    check_layout(config, tp, pp, vpp)
    chunks = vpp or 1
    megatron_args = None
    for stage in range(pp):
        for tp_rank in range(tp):
            states = [chunk_state(source, config, tp, tp_rank, chunk_layers(config, pp, chunks, stage, chunk),
                                  pre=stage == 0 and chunk == 0, post=stage == pp - 1 and chunk == chunks - 1)
                      for chunk in range(chunks)]
            if megatron_args is None:  # the stored dtype is Megatron's params_dtype (fp16 / bf16 flags)
                megatron_args = build_args(config, **{"params_dtype": params_dtype(states), **(args or {})},
                                           tp=tp, pp=pp, vpp=vpp if chunks > 1 else None,
                                           iteration=0 if iteration == "release" else iteration)
            if legacy_names:
                states = [mcore_to_legacy(chunk) for chunk in states]
            own = rank_extra(tp_rank, stage) if rank_extra is not None else {}
            write_rank_file(iter_dir / rank_dir_name(tp_rank, stage, pp),
                            rank_payload(states, megatron_args, iteration, {**(extra or {}), **own}))
            del states

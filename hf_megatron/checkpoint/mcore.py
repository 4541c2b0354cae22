"""Read torch-format Megatron checkpoints (`mp_rank_*/model_optim_rng.pt`): ours, megatron-core's
and Megatron-LM's (mcore, TransformerEngine or legacy names; `legacy.py` maps them).

    ckpt = MegatronCheckpoint(folder, iteration)
    ckpt.get("decoder.layers.7.mlp.linear_fc1.weight")   # merged over TP, global layer number

Rank files are opened with mmap and only one pipeline stage's files are held at a time, so
`get` costs one full tensor of memory.  Virtual-pipeline chunks (`model0`, `model1`, ...) and
uneven stages are placed by the layers each file holds.  `read_rank_file` gives one rank's
whole file (for resuming training in the saved layout).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ..parallel.sharding import VOCAB_PARAMS, merge_tensor, split_tensor
from .files import MODEL_FILE, rank_dir_name, resolve_iteration_dir, saved_layout
from .legacy import model_state_to_mcore
from .names import LAYER, chunk_keys, to_global_name
from .reader import ARGS, CheckpointReader, checkpoint_version, config_of, info_entries, vocab_rows_ok
from .shapes import check_tensor
from .unpickle import safe_load


def read_rank_file(load_dir: str | os.PathLike, tp_rank: int = 0, pp_rank: int = 0, pp_size: int = 1,
                   iteration: int | None = None) -> tuple[dict[str, Any], int | str, Path]:
    """(contents of one rank's model_optim_rng.pt, iteration, its file)."""
    folder, iteration = resolve_iteration_dir(load_dir, iteration)
    path = folder / rank_dir_name(tp_rank, pp_rank, pp_size) / MODEL_FILE
    if not path.parent.is_dir():
        tp, pp = saved_layout(folder)
        raise CheckpointError(f"{path.parent}: rank folder missing (the folder holds tp={tp}, pp={pp}; "
                              f"this run wants tp rank {tp_rank}, pp rank {pp_rank} of pp={pp_size})")
    payload = safe_load(path)
    if not isinstance(payload, dict):
        raise CheckpointError(f"{path}: expected a dict of checkpoint entries, found {type(payload).__name__}")
    return payload, iteration, path


class MegatronCheckpoint(CheckpointReader):
    def __init__(self, folder: Path, iteration, vocab_size: int | None = None):
        self.folder, self.iteration = folder, iteration
        self.tp, self.pp = saved_layout(folder)
        if not self.tp:
            raise CheckpointError(f"{folder}: no mp_rank_* folders (not a torch-format Megatron checkpoint)")
        first = self._load(0, 0)
        self.args = first.get("args")
        first_file = folder / rank_dir_name(0, 0, self.pp) / MODEL_FILE
        self.checkpoint_version = checkpoint_version(first.get("checkpoint_version"), first_file)
        self.info = info_entries(first)
        self._check_rank_folders()
        self.config = config_of(self.args, vocab_size, first_file)
        self.chunk_keys = chunk_keys(first)
        if not self.chunk_keys:
            raise CheckpointError(f"{folder / rank_dir_name(0, 0, self.pp) / MODEL_FILE}: no 'model' entry")
        self.vpp = len(self.chunk_keys)
        self._stage: tuple[int, list] | None = None
        self._place_layers()
        self._check_shards()

    # ---------------------------------------------------------------- files
    def _check_rank_folders(self) -> None:
        """The layout is the args' (tensor/pipeline_model_parallel_size) where they give it, else the
        folder names'; every rank folder of it must hold its file, and no other mp_rank folder may be
        there (a stray one names itself, never a layout nobody wrote)."""
        saved_tp = getattr(self.args, "tensor_model_parallel_size", None)
        saved_pp = getattr(self.args, "pipeline_model_parallel_size", None)
        from_args = all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (saved_tp, saved_pp))
        if from_args:
            self.tp, self.pp = saved_tp, saved_pp
            source = f"checkpoint args say tp={self.tp}, pp={self.pp}"
        else:
            source = f"the mp_rank folders make tp={self.tp}, pp={self.pp}"
        expected = {rank_dir_name(t, p, self.pp) for t in range(self.tp) for p in range(self.pp)}
        stray = sorted(d for d in self.folder.glob("mp_rank_*") if d.is_dir() and d.name not in expected)
        if stray:
            raise CheckpointError(f"{stray[0]}: unexpected rank folder ({source}: {', '.join(sorted(expected))}); "
                                  f"remove it or restore the checkpoint")
        for name in sorted(expected):
            if not (self.folder / name / MODEL_FILE).is_file():
                raise CheckpointError(f"{self.folder / name / MODEL_FILE}: missing ({source}; every mp_rank folder "
                                      f"must be present)")

    def _load(self, tp_rank: int, pp_rank: int) -> dict:
        path = self.folder / rank_dir_name(tp_rank, pp_rank, self.pp) / MODEL_FILE
        payload = safe_load(path, mmap=True)
        if not isinstance(payload, dict):
            raise CheckpointError(f"{path}: expected a dict of checkpoint entries, found {type(payload).__name__}")
        return payload

    def rank_state(self, tp_rank: int, pp_rank: int) -> list[dict[str, torch.Tensor]]:
        """One rank's model chunks as flat mcore-named dicts (stage-local layer numbers)."""
        payload = self._load(tp_rank, pp_rank)
        local_heads = self.config.num_attention_heads // self.tp
        missing = [k for k in self.chunk_keys if not isinstance(payload.get(k), dict)]
        if missing:
            raise CheckpointError(f"{self.folder / rank_dir_name(tp_rank, pp_rank, self.pp) / MODEL_FILE}: "
                                  f"no {missing[0]!r} state dict (rank 0 has {self.chunk_keys})")
        return [model_state_to_mcore(payload[k], self.checkpoint_version, local_heads) for k in self.chunk_keys]

    def _stage_states(self, pp_rank: int) -> list[list[dict]]:
        """[tp_rank][chunk] dicts of one stage; the previous stage's files are released."""
        if self._stage is None or self._stage[0] != pp_rank:
            self._stage = None
            self._stage = (pp_rank, [self.rank_state(t, pp_rank) for t in range(self.tp)])
        return self._stage[1]

    # ---------------------------------------------------------------- layer placement
    def _place_layers(self) -> None:
        """Global layer offset of every (stage, chunk): chunks run in order chunk-major
        (chunk v of stage p is model chunk v * pp + p), each with the layers its file holds."""
        counts = {}
        for p in range(self.pp):
            for v, chunk in enumerate(self._stage_states(p)[0]):
                layers = {int(m.group(1)) for m in map(LAYER.match, chunk) if m}
                counts[(p, v)] = max(layers) + 1 if layers else 0
        self.where: dict[str, tuple[int, int, str]] = {}  # global name -> (stage, chunk, local name)
        offset = 0
        for v in range(self.vpp):
            for p in range(self.pp):
                for local in self._stage_states(p)[0][v]:
                    name = to_global_name(local, offset)
                    if name not in self.where or name == "output_layer.weight":
                        self.where[name] = (p, v, local)
                offset += counts[(p, v)]
        if offset != self.config.num_layers:
            hf_config = getattr(self.args, "hf_config", None)
            field = "n_layer" if isinstance(hf_config, dict) and "n_layer" in hf_config else "num_hidden_layers"
            said = (f"args.hf_config says {field}={self.config.num_layers}"
                    if isinstance(hf_config, dict) and hf_config.get("model_type")
                    else f"args say num_layers={self.config.num_layers}")
            raise CheckpointError(f"{self.folder}: holds {offset} layers but {said}")

    def _check_shards(self) -> None:
        """Every rank file's shard of every weight, against the shard of the config's shape (vocab
        tables: any padding that covers the vocabulary)."""
        expected = self.expected_shapes()
        for p in range(self.pp):  # every rank of a stage holds the same names as its tp rank 0
            ranks = self._stage_states(p)
            for t, chunks in enumerate(ranks[1:], start=1):
                for v, chunk in enumerate(chunks):
                    extra = sorted(set(chunk) - set(ranks[0][v]))
                    if extra:
                        raise CheckpointError(f"{self.folder / rank_dir_name(t, p, self.pp) / MODEL_FILE}: tensor "
                                              f"{extra[0]!r} is not in tensor-parallel rank 0's file of its stage")
        for name, (p, v, local) in sorted(self.where.items(), key=lambda item: item[1][0]):
            want = split_tensor(name, torch.empty(expected[name], device="meta"), self.config, self.tp)
            ranks = self._stage_states(p)
            for t, chunks in enumerate(ranks):
                file = self.folder / rank_dir_name(t, p, self.pp) / MODEL_FILE
                tensor = chunks[v].get(local)
                if tensor is None:
                    raise CheckpointError(f"{file}: tensor {local!r} missing (tensor-parallel rank 0 of "
                                          f"pipeline stage {p} holds it)")
                shape = tuple(want[t].shape)
                first = ranks[0][v][local]
                if name in VOCAB_PARAMS and tensor.dim() == 2 and tuple(tensor.shape) == tuple(first.shape) \
                        and tensor.shape[1] == shape[1] and vocab_rows_ok(tensor.shape[0] * self.tp, self.config):
                    shape = tuple(tensor.shape)  # padded to another multiple: merge_tensor cuts it
                check_tensor(file, local, tensor.shape, tensor.dtype, shape, self.config, ARGS)

    def get(self, name: str) -> torch.Tensor:
        p, v, local = self.locate(name)
        try:
            shards = [ranks[v][local] for ranks in self._stage_states(p)]
        except KeyError:
            raise CheckpointError(f"{self.folder}: {local!r} of pipeline stage {p} is missing from some "
                                  f"tensor-parallel rank's file") from None
        return merge_tensor(name, shards, self.config)  # mmap-backed where unchanged: no copy

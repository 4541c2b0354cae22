"""Read a Megatron checkpoint folder (ours or Megatron-LM's) as full megatron-core tensors.

    ckpt = open_megatron(path)            # root with the tracker file, or an iter_*/release folder
    ckpt.config                           # ModelConfig (from args.hf_config, or from Megatron's flags)
    ckpt.get("decoder.layers.7.mlp.linear_fc1.weight")   # merged over TP, global layer number

Rank files are opened with mmap and only one pipeline stage's files are held at a time, so
`get` costs one full tensor of memory.  Handles mcore names, legacy names and QKV orders
(`legacy.py`), virtual-pipeline chunks (`model0`, `model1`, ...) and uneven stages; a
`torch_dist` folder is delegated to `torch_dist.py`.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from ..config import ModelConfig
from .hf_io import CheckpointError
from ..parallel.sharding import load_full_weights, merge_tensor
from .legacy import model_state_to_mcore
from .megatron_args import config_from_args
from .megatron_files import MODEL_FILE, rank_dir_name, resolve_iteration_dir, safe_load, saved_layout

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def open_megatron(path: str | os.PathLike, iteration: int | None = None, vocab_size: int | None = None):
    """A reader for a torch-format or torch_dist Megatron checkpoint."""
    folder, it = resolve_iteration_dir(path, iteration)
    if (folder / ".metadata").is_file() or (folder / "metadata.json").is_file():
        from .torch_dist import TorchDistCheckpoint
        return TorchDistCheckpoint(folder, it, vocab_size)
    return MegatronCheckpoint(folder, it, vocab_size)


class CheckpointReader:
    """What both readers share: `where` maps each full megatron-core name to its location."""
    folder: Path
    where: dict

    def names(self) -> list[str]:
        return list(self.where)

    def locate(self, name: str):
        try:
            return self.where[name]
        except KeyError:
            raise CheckpointError(f"{self.folder}: tensor {name!r} not found (wrong architecture for this checkpoint?)") from None

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {name: self.get(name) for name in self.names()}


class MegatronCheckpoint(CheckpointReader):
    def __init__(self, folder: Path, iteration, vocab_size: int | None = None):
        self.folder, self.iteration = folder, iteration
        self.tp, self.pp = saved_layout(folder)
        if not self.tp:
            raise CheckpointError(f"{folder}: no mp_rank_* folders (not a torch-format Megatron checkpoint)")
        first = self._load(0, 0)
        self.args = first.get("args")
        self.checkpoint_version = float(first.get("checkpoint_version", 0) or 0)
        self.info = {k: v for k, v in first.items() if not k.startswith(("model", "optimizer", "rng_state"))}
        saved_tp = getattr(self.args, "tensor_model_parallel_size", None) or self.tp
        saved_pp = getattr(self.args, "pipeline_model_parallel_size", None) or self.pp
        self.tp, self.pp = max(self.tp, saved_tp), max(self.pp, saved_pp)
        for t in range(self.tp):
            for p in range(self.pp):
                rank_dir = folder / rank_dir_name(t, p, self.pp)
                if not (rank_dir / MODEL_FILE).is_file():
                    raise CheckpointError(f"{rank_dir / MODEL_FILE}: missing (checkpoint args say tp={self.tp}, "
                                          f"pp={self.pp}; every mp_rank folder must be present)")
        self.config: ModelConfig = config_from_args(self.args, vocab_size)
        self.chunk_keys = sorted((k for k in first if re.fullmatch(r"model\d*", k)), key=lambda k: int(k[5:] or 0))
        if not self.chunk_keys:
            raise CheckpointError(f"{folder / rank_dir_name(0, 0, self.pp) / MODEL_FILE}: no 'model' entry")
        self.vpp = len(self.chunk_keys)
        self._stage: tuple[int, list] | None = None
        self._place_layers()

    # ---------------------------------------------------------------- files
    def _load(self, tp_rank: int, pp_rank: int) -> dict:
        return safe_load(self.folder / rank_dir_name(tp_rank, pp_rank, self.pp) / MODEL_FILE, mmap=True)

    def rank_state(self, tp_rank: int, pp_rank: int) -> list[dict[str, torch.Tensor]]:
        """One rank's model chunks as flat mcore-named dicts (stage-local layer numbers)."""
        payload = self._load(tp_rank, pp_rank)
        local_heads = self.config.num_attention_heads // self.tp
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
                layers = {int(m.group(1)) for m in map(_LAYER.match, chunk) if m}
                counts[(p, v)] = max(layers) + 1 if layers else 0
        self.where: dict[str, tuple[int, int, str]] = {}  # global name -> (stage, chunk, local name)
        offset = 0
        for v in range(self.vpp):
            for p in range(self.pp):
                for local in self._stage_states(p)[0][v]:
                    m = _LAYER.match(local)
                    name = f"decoder.layers.{int(m.group(1)) + offset}.{m.group(2)}" if m else local
                    if name not in self.where or name == "output_layer.weight":
                        self.where[name] = (p, v, local)
                offset += counts[(p, v)]
        if offset != self.config.num_layers:
            raise CheckpointError(f"{self.folder}: holds {offset} layers but args say num_layers={self.config.num_layers}")

    def get(self, name: str) -> torch.Tensor:
        p, v, local = self.locate(name)
        shards = [ranks[v][local] for ranks in self._stage_states(p)]
        return merge_tensor(name, shards, self.config)  # mmap-backed where unchanged: no copy


def load_megatron_weights(model, path: str | os.PathLike, iteration: int | None = None):
    """Load a Megatron checkpoint of *any* TP/PP layout into `model` (this rank's GPTModel, any
    layout): the full tensors of the model's layers are read, then sharded for this rank.
    Weights only; for exact resume in the saved layout use training.checkpoint.load_checkpoint."""
    ckpt = open_megatron(path, iteration)
    ours, theirs = model.config, ckpt.config
    fields = ("model_type", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
              "ffn_hidden_size", "vocab_size")
    diff = [f"{f}: model {getattr(ours, f)} vs checkpoint {getattr(theirs, f)}" for f in fields
            if getattr(ours, f) != getattr(theirs, f)]
    if diff:
        raise CheckpointError(f"{ckpt.folder}: checkpoint does not match the model ({'; '.join(diff)})")
    layers = set(model.layer_numbers)
    wanted = [n for n in ckpt.names() if not (m := _LAYER.match(n)) or int(m.group(1)) in layers]
    load_full_weights(model, ((n, ckpt.get(n)) for n in wanted))
    return ckpt

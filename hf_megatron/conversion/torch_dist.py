"""Read Megatron's `torch_dist` checkpoints (torch.distributed.checkpoint, written by megatron-core).

    iter_0000100/.metadata  __0_0.distcp ...  common.pt  metadata.json

Tensors are stored once at global shape under their *sharded* key: per-layer parameters are
stacked on a leading layer axis (`decoder.layers.mlp.linear_fc1.weight` is [L, ...]); TP shards
are already concatenated; vocab tables keep their padding; SwiGLU fc1 is [gate; up] (or two
keys `..._w` / `..._v` when saved with singleton local shards).  `get` reads just the slice of
one layer (a LoadPlan for that chunk), without a process group.

Common state (args, iteration, checkpoint_version) comes from `common.pt`, or -- the other
layout -- from byte entries inside the DCP files.  Nothing is unpickled as code: `.metadata`
goes through a restricted unpickler (torch.distributed.checkpoint's metadata classes only)
and every byte entry through `safe_load`.
"""
from __future__ import annotations

import io
import pickle
import re
from pathlib import Path

import torch

from ..config import ModelConfig
from .hf_io import CheckpointError
from .layout import VOCAB_PARAMS
from .legacy import te_to_local_name
from .megatron_args import config_from_args
from .megatron_ckpt import CheckpointReader
from .megatron_files import safe_load

_LAYERS = "decoder.layers."
_MODEL_PREFIX = re.compile(r"^model\d*\.")
_SAFE_MODULE_PREFIXES = ("torch.distributed.checkpoint.",)
_SAFE_GLOBALS = {("collections", "OrderedDict"), ("torch", "Size"), ("builtins", "set"), ("builtins", "frozenset"),
                 ("builtins", "slice"), ("torch.serialization", "_get_layout"),  # name -> torch.layout
                 *((module, cls) for module in ("pathlib", "pathlib._local")  # the checkpoint id
                   for cls in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"))}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module.startswith(_SAFE_MODULE_PREFIXES) or (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from checkpoint metadata")


def _reader_class():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with open(Path(self.path) / ".metadata", "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader


def _planner(fqn: str, offsets, sizes):
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class ChunkPlanner(DefaultLoadPlanner):
        """Loads one box (offsets, sizes) of one entry; byte entries through safe_load."""

        def create_local_plan(self):
            if offsets is None:  # a byte entry: the default plan reads it whole
                return super().create_local_plan()
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            return LoadPlan(create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], [chunk]))

        def lookup_tensor(self, index):
            return self.state_dict[index.fqn]

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            self.state_dict[read_item.dest_index.fqn] = safe_load(io.BytesIO(value.read()))

    return ChunkPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)  # results land in our dict


class TorchDistCheckpoint(CheckpointReader):
    def __init__(self, folder: Path, iteration, vocab_size: int | None = None):
        self.folder, self.iteration = Path(folder), iteration
        self._reader_cls = _reader_class()
        try:
            self.metadata = self._reader_cls(str(folder)).read_metadata()
        except Exception as exc:
            raise CheckpointError(f"{folder / '.metadata'}: unreadable torch_dist metadata ({type(exc).__name__}: {exc})") from None
        entries = self.metadata.state_dict_metadata
        common_file = folder / "common.pt"
        common = safe_load(common_file) if common_file.is_file() else self._common_from_bytes(entries)
        self.args = common.get("args")
        self.checkpoint_version = float(common.get("checkpoint_version", 3.0) or 3.0)
        self.info = {k: v for k, v in common.items() if not k.startswith(("model", "optimizer", "rng_state"))}
        self.config: ModelConfig = config_from_args(self.args, vocab_size)
        self.tp = getattr(self.args, "tensor_model_parallel_size", 1)
        self.pp = getattr(self.args, "pipeline_model_parallel_size", 1)
        self.where: dict[str, tuple[str, int | None, str | None]] = {}
        tensor_keys = [k for k, md in entries.items() if hasattr(md, "chunks") and hasattr(md, "size")]
        for key in tensor_keys:
            name = te_to_local_name(_MODEL_PREFIX.sub("", key))
            part = None
            if name[-2:] in ("_w", "_v") and name[:-2].endswith(("linear_fc1.weight", "linear_fc1.bias")):
                name, part = name[:-2], name[-1]
            if name.startswith(_LAYERS):
                suffix = name[len(_LAYERS):]
                for layer in range(entries[key].size[0]):
                    self.where.setdefault(f"{_LAYERS}{layer}.{suffix}", (key if part is None else key[:-2], layer, part))
            elif name.startswith(("embedding.", "decoder.final_layernorm.", "output_layer.")):
                self.where.setdefault(name, (key if part is None else key[:-2], None, part))
        if not any(n.startswith(_LAYERS) for n in self.where):
            raise CheckpointError(f"{folder}: torch_dist checkpoint holds no decoder.layers.* model tensors")

    def _common_from_bytes(self, entries) -> dict:
        common = {}
        for key, md in entries.items():
            if not hasattr(md, "chunks") and key.split(".")[0] in ("args", "iteration", "checkpoint_version"):
                common[key.split(".")[0]] = self._load({key: None}, key, None, None)[key]
        if "args" not in common:
            raise CheckpointError(f"{self.folder}: no common.pt and no 'args' entry; cannot tell the architecture")
        return common

    def _load(self, state: dict, fqn: str, offsets, sizes) -> dict:
        import torch.distributed.checkpoint as dcp
        dcp.load(state, storage_reader=self._reader_cls(str(self.folder)), planner=_planner(fqn, offsets, sizes),
                 no_dist=True)
        return state

    def _read(self, key: str, layer: int | None) -> torch.Tensor:
        md = self.metadata.state_dict_metadata[key]
        size = list(md.size)
        offsets = [0] * len(size)
        if layer is not None:
            offsets[0], size[0] = layer, 1
        dest = torch.empty(size, dtype=md.properties.dtype)
        self._load({key: dest}, key, offsets, size)
        return dest[0] if layer is not None else dest

    def get(self, name: str) -> torch.Tensor:
        key, layer, part = self.locate(name)
        if part is None:
            tensor = self._read(key, layer)
        else:  # gate and up stored separately
            tensor = torch.cat([self._read(key + "_w", layer), self._read(key + "_v", layer)])
        return tensor[: self.config.vocab_size] if name in VOCAB_PARAMS else tensor

"""Read Megatron's `torch_dist` checkpoints (torch.distributed.checkpoint, written by megatron-core).

    iter_0000100/.metadata  __0_0.distcp ...  common.pt  metadata.json

Tensors are stored once at global shape under their *sharded* key: per-layer parameters are
stacked on a leading layer axis (`decoder.layers.mlp.linear_fc1.weight` is [L, ...]); TP shards
are already concatenated; vocab tables keep their padding; SwiGLU fc1 is [gate; up] (or two
keys `..._w` / `..._v` when saved with singleton local shards).  `get` reads just the slice of
one layer (a LoadPlan for that chunk), without a process group.

`write_torch_dist` writes this format from full tensors (converter output `--ckpt-format torch_dist`).

Common state (args, iteration, checkpoint_version) comes from `common.pt`, or -- the other
layout -- from byte entries inside the DCP files.  Nothing is unpickled as code: `.metadata`
goes through an unpickler that knows exactly the classes torch.distributed.checkpoint writes
there (`METADATA_GLOBALS`), every byte entry and `common.pt` through `safe_load`; DCP reads the
tensor data itself with `torch.load(weights_only=True)`.
"""
from __future__ import annotations

import collections
import io
import json
import pathlib
import re
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem, metadata as dcp_metadata, planner as dcp_planner
from torch.distributed.checkpoint.api import CheckpointException as DCPFailure
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..errors import CheckpointError
from ..parallel.sharding import VOCAB_PARAMS, pad_vocab
from .args import build_args
from .checksums import verify_folder
from .files import save_atomic, write_text_atomic
from .legacy import local_to_te_name, te_to_local_name
from .names import LAYER
from .reader import ARGS, CheckpointReader, checkpoint_version, config_of, info_entries, vocab_rows_ok
from .shapes import check_tensor
from .unpickle import first_line, load_pickle, own_safe_globals, safe_load
from .writer import CHECKPOINT_VERSION, params_dtype

_LAYERS = "decoder.layers."
COMMON_FILE = "common.pt"  # megatron-core's common state of a torch_dist folder
_MODEL_PREFIX = re.compile(r"^model\d*\.")

# exactly what torch.distributed.checkpoint pickles into `.metadata` (and nothing reachable from it)
METADATA_GLOBALS: dict[tuple[str, str], object] = {
    **{("torch.distributed.checkpoint.metadata", cls): getattr(dcp_metadata, cls) for cls in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): filesystem._StorageInfo,
    # megatron-core keeps its cached save plans in the metadata
    **{("torch.distributed.checkpoint.planner", cls): getattr(dcp_planner, cls) for cls in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData")},
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # layout name -> torch.layout
    **{("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)},
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set, ("builtins", "frozenset"): frozenset, ("builtins", "slice"): slice,
    **{(module, cls): getattr(pathlib, cls)  # the checkpoint id; pathlib._local on Python >= 3.13
       for module in ("pathlib", "pathlib._local") for cls in ("PosixPath", "PurePosixPath", "PureWindowsPath")},
}


class SafeReader(filesystem.FileSystemReader):
    """FileSystemReader whose metadata goes through the allow-list unpickler."""

    def read_metadata(self, *args, **kwargs):
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        with open(path, "rb") as f:
            metadata = load_pickle(f, METADATA_GLOBALS, str(path))
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise CheckpointError(f"{path}: expected torch.distributed.checkpoint Metadata, found {type(metadata).__name__}")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class ChunkPlanner(DefaultLoadPlanner):
    """Loads one box (offsets, sizes) of entry `fqn`, or a whole byte entry through safe_load;
    results land in the caller's dict."""

    def __init__(self, fqn: str, offsets=None, sizes=None):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.fqn, self.offsets, self.sizes = fqn, offsets, sizes

    def create_local_plan(self):
        if self.offsets is None:  # a byte entry: the default plan reads it whole
            return super().create_local_plan()
        chunk = dcp_metadata.ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=torch.Size(self.sizes))
        return dcp_planner.LoadPlan(create_read_items_for_chunk_list(self.fqn, self.metadata.state_dict_metadata[self.fqn], [chunk]))

    def lookup_tensor(self, index):
        return self.state_dict[index.fqn]

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = safe_load(io.BytesIO(value.read()))


class TorchDistCheckpoint(CheckpointReader):
    def __init__(self, folder: Path, iteration, vocab_size: int | None = None):
        self.folder, self.iteration = Path(folder), iteration
        verify_folder(self.folder)  # the .distcp files, where their sidecars exist
        self.metadata = SafeReader(str(folder)).read_metadata()
        entries = self.metadata.state_dict_metadata
        common_file = folder / "common.pt"
        common = safe_load(common_file) if common_file.is_file() else self._common_from_bytes(entries)
        if not isinstance(common, dict):
            raise CheckpointError(f"{common_file}: expected a dict of common state, found {type(common).__name__}")
        self.args = common.get("args")
        self.checkpoint_version = checkpoint_version(common.get("checkpoint_version", 3.0), folder)
        self.info = info_entries(common)
        self.config = config_of(self.args, vocab_size, folder)
        self.tp = getattr(self.args, "tensor_model_parallel_size", 1)
        self.pp = getattr(self.args, "pipeline_model_parallel_size", 1)
        self.where: dict[str, tuple[str, int | None, str | None]] = {}
        tensor_keys = [k for k, md in entries.items() if isinstance(md, dcp_metadata.TensorStorageMetadata)]
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
        self._check_entries()

    def _check_entries(self) -> None:
        """Every weight's global entry (from `.metadata`, nothing read) against the config's shape:
        per-layer entries are [num_layers, ...]; fc1 parts `_w`/`_v` are half of fc1 each; vocab
        tables padded to cover the vocabulary."""
        expected = self.expected_shapes()
        entries = self.metadata.state_dict_metadata
        layers = self.config.num_layers
        for name, (key, layer, part) in self.where.items():
            for stored in ([key] if part is None else [key + "_w", key + "_v"]):
                md = entries.get(stored)
                if md is None:
                    raise CheckpointError(f"{self.folder}: entry {stored!r} missing (its {key[:-2]}_w/_v twin is there)")
                size = tuple(md.size)
                if layer is not None and (not size or size[0] != layers):
                    raise CheckpointError(f"{self.folder}: entry {stored!r} has shape {size}, expected "
                                          f"[{layers}, ...] (one slice per layer; args say num_layers={layers})")
                shape = size[1:] if layer is not None else size
                if part is not None and shape:
                    shape = (shape[0] * 2,) + shape[1:]
                want = tuple(expected[name])
                if name in VOCAB_PARAMS and len(shape) == 2 and shape[1] == want[1] and vocab_rows_ok(shape[0], self.config):
                    shape = want  # vocab padding is cut on read
                check_tensor(self.folder, stored if layer is None else f"{stored}[{layer}]", shape,
                             md.properties.dtype, want, self.config, ARGS)

    def _common_from_bytes(self, entries) -> dict:
        common = {}
        for key, md in entries.items():
            if isinstance(md, dcp_metadata.BytesStorageMetadata) and key.split(".")[0] in ("args", "iteration",
                                                                                             "checkpoint_version"):
                common[key.split(".")[0]] = self.read_object(key)
        if "args" not in common:
            raise CheckpointError(f"{self.folder}: no common.pt and no 'args' entry; cannot tell the architecture")
        return common

    def read_object(self, key: str):
        """A byte entry (megatron-core's ShardedObject, common state), through safe_load."""
        return self._load({key: None}, ChunkPlanner(key))[key]

    def _load(self, state: dict, planner: ChunkPlanner) -> dict:
        try:
            with own_safe_globals():  # DCP reads tensor data with torch.load(weights_only=True)
                dcp.load(state, storage_reader=SafeReader(str(self.folder)), planner=planner, no_dist=True)
        except CheckpointError as exc:
            raise _in_folder(exc, self.folder, planner.fqn) from None
        except (Exception, DCPFailure) as exc:  # DCP wraps what its reader raised: surface ours, else one line
            cause = next((e for e in _causes(exc) if isinstance(e, CheckpointError)), None)
            if cause is not None:
                raise _in_folder(cause, self.folder, planner.fqn) from None
            raise CheckpointError(f"{self.folder}: cannot read {planner.fqn!r} (not a loadable entry: "
                                  f"{first_line(exc)})") from None
        return state

    def _read(self, key: str, layer: int | None) -> torch.Tensor:
        md = self.metadata.state_dict_metadata[key]
        size = list(md.size)
        offsets = [0] * len(size)
        if layer is not None:
            offsets[0], size[0] = layer, 1
        dest = torch.empty(size, dtype=md.properties.dtype)
        self._load({key: dest}, ChunkPlanner(key, offsets, size))
        return dest[0] if layer is not None else dest

    def get(self, name: str, prefix: str = "") -> torch.Tensor:
        """Full tensor `name`; with `prefix`, the entry megatron-core stores under `prefix + its
        sharded key` at the same shape (the optimizer's `optimizer.state.exp_avg.<key>`, ...)."""
        key, layer, part = self.locate(name)
        keys = [key] if part is None else [key + "_w", key + "_v"]  # gate and up stored separately
        if prefix:
            entries = self.metadata.state_dict_metadata
            for stored in keys:
                md = entries.get(prefix + stored)
                if not isinstance(md, dcp_metadata.TensorStorageMetadata) or md.size != entries[stored].size:
                    found = "missing" if md is None else f"of shape {tuple(getattr(md, 'size', ()))}"
                    raise CheckpointError(f"{self.folder}: entry {prefix + stored!r} {found}, expected a tensor "
                                          f"of {stored!r}'s shape {tuple(entries[stored].size)}")
        tensor = torch.cat([self._read(prefix + k, layer) for k in keys])
        return tensor[: self.config.vocab_size] if name in VOCAB_PARAMS else tensor


def _in_folder(exc: CheckpointError, folder: Path, fqn: str) -> CheckpointError:
    """An error about an in-memory entry ("<stream>: ...") as one about this checkpoint's entry."""
    text = str(exc)
    return CheckpointError(f"{folder}: entry {fqn!r}{text[len('<stream>'):]}") if text.startswith("<stream>") else exc


def _causes(exc: BaseException):
    """exc, its causes/contexts, and the per-rank failures a DCP CheckpointException carries."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        if isinstance(e, DCPFailure):  # rank -> (exception, traceback)
            todo += [failure[0] for failure in e.failures.values()]


# ---------------------------------------------------------------- writing

# metadata.json: megatron-core's CheckpointingConfig (dist_checkpointing/core.py)
CHECKPOINTING_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                        "common_backend": "torch", "common_backend_version": 1}


# the linear layers whose (empty, for megatron-core's local layers) `_extra_state` megatron-core
# saves as one ShardedObject per layer: bytes entry `<key>._extra_state/shard_<layer>_<L>`
_EXTRA_STATE_OWNERS = re.compile(r"^((self_attention\.linear_(qkv|proj)|mlp\.linear_fc[12]))\.weight$")


def sharded_key(name: str) -> tuple[str, int | None]:
    """Full name -> (megatron-core's sharded key, layer): `decoder.layers.7.mlp.linear_fc1.weight`
    is row 7 of `decoder.layers.mlp.linear_fc1.weight` [L, ...]; other names are their own key.
    Norms take TransformerEngine's fused names, as megatron-core's local layers also save them."""
    match = LAYER.match(name)
    if not match:
        return name, None
    return local_to_te_name(f"{_LAYERS}{match.group(2)}"), int(match.group(1))




def global_entries(config, named, tp: int = 1, prefix: str = "", extra_state: bool = False,
                   where: Path | str = "") -> dict:
    """{prefix + sharded key: global tensor} from the full tensors `named` ((full name, tensor) of every
    layer): per-layer tensors stacked on a leading layer axis [L, ...], vocab tables padded for `tp`
    (zero rows).  `extra_state`: also the linear layers' empty `_extra_state` objects, one `[None]`
    bytes entry per layer (what megatron-core saves for its local layers).  The optimizer's entries are
    the model's under `optimizer.state.<state key>.` (megatron-core's `make_sharded_optimizer_tensor`)."""
    layers: dict[str, list] = {}
    state: dict[str, torch.Tensor | list] = {}
    for name, tensor in named:
        key, layer = sharded_key(name)
        if layer is None:
            state[prefix + key] = pad_vocab(tensor, config.padded_vocab_size(tp)) if name in VOCAB_PARAMS else tensor
            continue
        layers.setdefault(key, [None] * config.num_layers)[layer] = tensor
        owner = _EXTRA_STATE_OWNERS.match(key[len(_LAYERS):])
        if extra_state and owner:
            # megatron-core's bytes: torch.save of the list of the objects' data (DCP saves it)
            state[f"{_LAYERS}{owner.group(1)}._extra_state/shard_{layer}_{config.num_layers}"] = [None]
    for key, per_layer in layers.items():
        missing = [i for i, t in enumerate(per_layer) if t is None]
        if missing:
            raise CheckpointError(f"{where}: the source gave no {prefix}{key} for layers {missing[:4]}")
        state[prefix + key] = torch.stack(per_layer)
    return state


def save_entries(iter_dir: Path, state: dict) -> None:
    """torch.distributed.checkpoint of `state` into iter_dir (.metadata, __0_0.distcp), from this process
    alone; byte entries (lists, ShardedObject data) stay whole entries."""
    iter_dir.mkdir(parents=True, exist_ok=True)
    dcp.save(state, storage_writer=filesystem.FileSystemWriter(str(iter_dir)), no_dist=True,
             planner=DefaultSavePlanner(flatten_state_dict=False))


def save_common(iter_dir: Path, common: dict) -> None:
    """common.pt (megatron-core's common state: args, iteration, ...) and metadata.json (its backends)."""
    save_atomic(common, iter_dir / COMMON_FILE)
    write_text_atomic(iter_dir / "metadata.json", json.dumps(CHECKPOINTING_CONFIG))


def write_torch_dist(iter_dir: Path, config, source, tp: int = 1, pp: int = 1, iteration: int | str = "release",
                     args: dict | None = None) -> None:
    """Write the full tensors of `source` (writer.Source) as megatron-core's torch_dist folder:

        iter_dir/.metadata, __0_0.distcp     torch.distributed.checkpoint, one entry per sharded key:
                                             per-layer tensors stacked on a leading layer axis [L, ...],
                                             TP shards merged, vocab tables padded for `tp`;
                                             the linear layers' empty `_extra_state` objects
        iter_dir/common.pt                   args (ckpt_format torch_dist), iteration, checkpoint_version
        iter_dir/metadata.json               the backends (CHECKPOINTING_CONFIG)

    Any TP/PP layout loads it (megatron-core reads each rank's boxes); `tp`/`pp` are recorded in
    args and set the vocab padding.  Memory: the whole model, once (DCP plans one save)."""
    state = global_entries(config, source(range(config.num_layers)), tp, extra_state=True, where=iter_dir)
    save_entries(iter_dir, state)
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    megatron_args = build_args(config, **{"params_dtype": params_dtype([tensors]), **(args or {})}, tp=tp, pp=pp,
                               iteration=0 if iteration == "release" else iteration, ckpt_format="torch_dist")
    save_common(iter_dir, {"args": megatron_args, "checkpoint_version": CHECKPOINT_VERSION,
                           "iteration": 0 if iteration == "release" else iteration})

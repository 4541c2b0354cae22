"""Helpers that damage checkpoints in controlled ways (no tests here): rewrite one HF safetensors
tensor, one Megatron rank file entry, or build a torch_dist folder from full tensors."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file


def edit_safetensors(folder: Path, edit: Callable[[dict], None], file: str = "model.safetensors") -> Path:
    """Apply `edit(tensors)` to one safetensors file of an HF folder (in place)."""
    path = Path(folder) / file
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def rank_file(root: Path, tp_rank: int = 0, pp_rank: int = 0, pp: int = 1, iteration: str = "release") -> Path:
    suffix = f"_{pp_rank:03d}" if pp > 1 else ""
    return Path(root) / iteration / f"mp_rank_{tp_rank:02d}{suffix}" / "model_optim_rng.pt"


def edit_rank_file(path: Path, edit: Callable[[dict], None]) -> Path:
    """Apply `edit(model_state_dict)` to the `model` entry of a rank file we wrote (in place)."""
    from hf_megatron.checkpoint.checksums import write_checksum
    payload = torch.load(path, weights_only=False)  # our own test file
    edit(payload["model"])
    torch.save(payload, path)
    write_checksum(path)  # a consistent (if wrong) checkpoint: what is tested is the check after the checksum
    return path


def write_torch_dist(full: dict[str, torch.Tensor], args: argparse.Namespace, root: Path, num_layers: int,
                     iteration: int = 9) -> Path:
    """A torch_dist checkpoint as megatron-core stores one: per-layer tensors stacked on a leading
    layer axis, `args` and `iteration` as byte entries (no common.pt)."""
    import torch.distributed.checkpoint as dcp
    state: dict = {}
    for name, tensor in full.items():
        if name.startswith("decoder.layers."):
            suffix = name.split(".", 3)[3]
            key = "decoder.layers." + suffix
            if key not in state:
                state[key] = torch.stack([full[f"decoder.layers.{i}.{suffix}"] for i in range(num_layers)])
        else:
            state[name] = tensor
    state["args"], state["iteration"] = args, iteration
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(Path(root) / f"iter_{iteration:07d}")), no_dist=True)
    (Path(root) / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return Path(root)


def flip_tensor_byte(path: Path) -> int:
    """Flip one byte in the middle of the largest tensor record of a torch.save zip file (stored
    uncompressed); returns its offset in the file."""
    import struct
    import zipfile
    with zipfile.ZipFile(path) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = bytearray(Path(path).read_bytes())
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26: info.header_offset + 30])
    offset = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
    raw[offset] ^= 0x10
    Path(path).write_bytes(bytes(raw))
    return offset

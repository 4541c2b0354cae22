"""Reading a Hugging Face checkpoint lazily: a local folder written by `save_pretrained`, or a
Hub repo id (downloaded through huggingface_hub, so HF_HUB_OFFLINE and the cache apply).

`HFCheckpoint(path).get(name)` opens only the safetensors file that holds `name`, so a
converter can stream a large model one tensor at a time.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

WEIGHT_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


from ..errors import CheckpointError  # noqa: E402  (re-exported)


def resolve(name_or_path: str | os.PathLike) -> Path:
    """A local folder as is; otherwise a Hub repo id, fetched (or found in the cache)."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{path}: expected a folder written by save_pretrained, found a file")
    if str(name_or_path).startswith((".", "/")) or str(name_or_path).count("/") > 1:
        raise CheckpointError(f"{path}: no such folder")
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(str(name_or_path), allow_patterns=WEIGHT_PATTERNS + ["*.json", *TOKENIZER_FILES]))
    except Exception as exc:  # offline, unknown repo, auth: say which and why in one line
        raise CheckpointError(f"{name_or_path}: not a local folder and could not be fetched from the Hub "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None


def link_root(folder: Path) -> Path:
    """The folder that symlinks in `folder` may point into: for a Hub cache snapshot
    (`models--org--name/snapshots/<rev>/`, whose files link to `../../blobs/`) the repo's cache
    folder; for any other folder, the folder itself."""
    folder = Path(folder)
    repo = folder.parent.parent
    if folder.parent.name == "snapshots" and repo.name.startswith("models--") and (repo / "blobs").is_dir():
        return repo
    return folder


class HFCheckpoint:
    def __init__(self, name_or_path: str | os.PathLike):
        self.path = resolve(name_or_path)
        config_file = self.path / "config.json"
        if not config_file.is_file():
            raise CheckpointError(f"{config_file}: missing (not a save_pretrained folder)")
        try:
            self.config = json.loads(config_file.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{config_file}: not valid JSON ({exc})") from None
        self._where: dict[str, Path] = {}
        self._bin_cache: dict[Path, dict] = {}
        self._index()

    def _index(self) -> None:
        from safetensors import safe_open
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._where = {k: self.path / v for k, v in weight_map.items()}
            for file in set(self._where.values()):
                if not file.is_file():
                    raise CheckpointError(f"{file}: listed in {index.name} but missing")
        elif single.is_file():
            try:
                with safe_open(str(single), framework="pt") as f:
                    self._where = {k: single for k in f.keys()}
            except Exception as exc:
                raise CheckpointError(f"{single}: unreadable safetensors file ({exc})") from None
        else:
            bins = sorted(self.path.glob("pytorch_model*.bin"))
            if not bins:
                raise CheckpointError(f"{self.path}: no model.safetensors, safetensors index or pytorch_model.bin")
            for file in bins:
                for k in self._load_bin(file):
                    self._where[k] = file

    def _load_bin(self, file: Path) -> dict:
        if file not in self._bin_cache:
            self._bin_cache[file] = torch.load(file, map_location="cpu", weights_only=True)
        return self._bin_cache[file]

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return self._stored_name(name) in self._where

    def _stored_name(self, name: str) -> str:
        """Base-model checkpoints (e.g. the Hub's gpt2) store names without `transformer.`/`model.`."""
        if name not in self._where:
            head, _, rest = name.partition(".")
            if head in ("transformer", "model") and rest in self._where:
                return rest
        return name

    def get(self, name: str) -> torch.Tensor:
        name = self._stored_name(name)
        file = self._where.get(name)
        if file is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} not found in the checkpoint")
        if file.suffix == ".bin":
            return self._load_bin(file)[name]
        from safetensors import safe_open
        try:
            with safe_open(str(file), framework="pt") as f:
                return f.get_tensor(name)
        except Exception as exc:
            raise CheckpointError(f"{file}: cannot read tensor {name!r} ({exc})") from None

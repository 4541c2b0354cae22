"""Reading a Hugging Face checkpoint lazily: a local folder written by `save_pretrained`, or a
Hub repo id (downloaded through huggingface_hub, so HF_HUB_OFFLINE and the cache apply).

`HFCheckpoint(path).get(name)` opens only the safetensors file that holds `name`, so a
converter can stream a large model one tensor at a time.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch

from ..checkpoint.files import within
from ..checkpoint.unpickle import first_line
from ..errors import CheckpointError  # re-exported

WEIGHT_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
                   "megatron_tokenizer.json")  # the last: a SentencePiece file's Megatron-LM kind (training/tokenizer_files)

# safetensors header dtype codes -> torch (what a weight may be; anything else reads as uint8: refused)
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


def _weight_map(index: Path) -> dict[str, str]:
    """The `weight_map` of a safetensors index (a JSON object of name -> file in the folder)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{index}: not valid JSON ({exc})") from None
    except (KeyError, TypeError):
        raise CheckpointError(f"{index}: expected a JSON object with a 'weight_map'") from None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) and v
                                                   for k, v in weight_map.items()):
        raise CheckpointError(f"{index}: 'weight_map' must map tensor names to file names")
    return weight_map


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


@contextlib.contextmanager
def open_safetensors(file: Path):
    """safetensors' `safe_open` of `file`; a file it cannot open (not safetensors, a header or data
    cut short) is one CheckpointError naming it.  CheckpointErrors of the body pass unchanged."""
    from safetensors import safe_open
    try:
        with safe_open(str(file), framework="pt") as f:
            yield f
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{file}: unreadable or truncated safetensors file ({first_line(exc)})") from None


class HFCheckpoint:
    def __init__(self, name_or_path: str | os.PathLike):
        self.path = resolve(name_or_path)
        config_file = self.path / "config.json"
        if not config_file.is_file():
            raise CheckpointError(f"{config_file}: missing (not a save_pretrained folder)")
        self.file(config_file.name)
        try:
            self.config = json.loads(config_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{config_file}: not valid JSON ({exc})") from None
        if not isinstance(self.config, dict):
            raise CheckpointError(f"{config_file}: expected a JSON object, found {type(self.config).__name__}")
        self._where: dict[str, Path] = {}
        self._bin_cache: dict[Path, dict] = {}
        self._index()

    def file(self, name: str | os.PathLike) -> Path:
        """`<folder>/name`, refused in one line where a symlink takes it out of the folder (a Hub cache
        snapshot's links into its blobs are in)."""
        return within(self.path / name, link_root(self.path))

    def _index(self) -> None:
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.is_file():
            self._where = {k: self.path / v for k, v in _weight_map(self.file(index.name)).items()}
            for file in set(self._where.values()):
                self.file(file.relative_to(self.path))
                if not file.is_file():
                    raise CheckpointError(f"{file}: listed in {index.name} but missing")
        elif single.is_file():
            self.file(single.name)
            with open_safetensors(single) as f:
                self._where = {k: single for k in f.keys()}
        else:
            bins = sorted(self.path.glob("pytorch_model*.bin"))
            if not bins:
                raise CheckpointError(f"{self.path}: no model.safetensors, safetensors index or pytorch_model.bin")
            for file in bins:
                for k in self._load_bin(self.file(file.name)):
                    self._where[k] = file

    def _load_bin(self, file: Path) -> dict:
        if file not in self._bin_cache:
            try:
                state = torch.load(file, map_location="cpu", weights_only=True)
            except Exception as exc:  # weights-only unpickling refused it, or not a torch file at all
                raise CheckpointError(f"{file}: unreadable pytorch_model file ({first_line(exc)})") from None
            if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
                raise CheckpointError(f"{file}: expected a state dict of tensors, found {type(state).__name__}")
            self._bin_cache[file] = state
        return self._bin_cache[file]

    def stored(self) -> dict[str, tuple[Path, tuple[int, ...], torch.dtype]]:
        """name -> (file, shape, dtype) of every stored tensor, from the safetensors headers
        (no tensor data read)."""
        found: dict[str, tuple[Path, tuple[int, ...], torch.dtype]] = {}
        by_file: dict[Path, list[str]] = {}
        for name, file in self._where.items():
            by_file.setdefault(file, []).append(name)
        for file, names in by_file.items():
            if file.suffix == ".bin":
                state = self._load_bin(file)
                found.update({n: (file, tuple(state[n].shape), state[n].dtype) for n in names if n in state})
                continue
            with open_safetensors(file) as f:
                keys = set(f.keys())
                for name in names:
                    if name not in keys:
                        raise CheckpointError(f"{file}: tensor {name!r} is listed in the index but not in the file")
                    piece = f.get_slice(name)
                    found[name] = (file, tuple(piece.get_shape()), _SAFETENSORS_DTYPES.get(piece.get_dtype(), torch.uint8))
        return found

    def check(self, config) -> None:
        """Every weight `config` needs is stored, at its shape, in a floating dtype (one line naming
        the file and the first bad tensor otherwise); names as `get` takes them."""
        from ..checkpoint.shapes import check_missing, check_tensor
        from .layout import hf_shapes
        expected = hf_shapes(config)
        stored = self.stored()
        present = {name for name in expected if self._stored_name(name) in stored}
        check_missing(self.path, present, expected, config, "config.json")
        for name in expected:
            file, shape, dtype = stored[self._stored_name(name)]
            check_tensor(file, name, shape, dtype, expected[name], config, "config.json")
        self._check_unexpected(config, {self._stored_name(name) for name in expected}, stored)

    def _check_unexpected(self, config, used: set[str], stored: dict) -> None:
        """A stored tensor the model has no place for is an error (one line naming its file), never
        dropped -- except what transformers also passes over (the family's `unused_hf_tensors`) and
        a tied model's `lm_head.weight` that equals the embedding (older save_pretrained wrote both)."""
        from ..architectures import get as architecture
        from ..checkpoint.shapes import describe
        arch = architecture(config.model_type)
        ignored = arch.unused_hf_tensors(config)
        extra = [name for name in stored if name not in used and not ignored.search(name)]
        if config.tie_word_embeddings and "lm_head.weight" in extra:
            extra.remove("lm_head.weight")
            (embedding,) = arch.hf_names(config, "embedding.word_embeddings.weight")
            head, table = self.get("lm_head.weight"), self.get(embedding)
            if head.shape != table.shape or not torch.equal(head, table.to(head.dtype)):
                raise CheckpointError(
                    f"{stored['lm_head.weight'][0]}: lm_head.weight differs from {self._stored_name(embedding)}, but "
                    f"{self.path / 'config.json'} says tie_word_embeddings=true (transformers would use the "
                    f"embedding and drop lm_head.weight); set tie_word_embeddings to false to keep this head")
        if extra:
            file = stored[extra[0]][0]
            more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
            raise CheckpointError(f"{file}: unexpected tensor {extra[0]!r}{more}: not part of the model "
                                  f"{self.path / 'config.json'} describes ({describe(config)})")

    def auto_dtype(self) -> torch.dtype:
        """The dtype transformers' `from_pretrained(dtype="auto")` loads this checkpoint in: config.json's
        `dtype` (transformers 5) or `torch_dtype` (4.x), else the first floating-point stored tensor's.
        A value that names no torch floating dtype is a ConfigError naming the file (transformers
        fails on it with an AttributeError)."""
        from ..errors import ConfigError
        for key in ("dtype", "torch_dtype"):
            name = self.config.get(key)
            if name is None:
                continue
            dtype = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
            if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise ConfigError(f"{self.path / 'config.json'}: field {key!r}: expected a torch floating dtype "
                                  f"name such as 'bfloat16' or 'float32', got {name!r}")
            return dtype
        for _, _, dtype in self.stored().values():
            if dtype.is_floating_point:
                return dtype
        return torch.get_default_dtype()

    def model_config(self):
        """The ModelConfig of config.json; a field we cannot use is an error naming the file."""
        from ..config import ModelConfig
        from ..errors import ConfigError
        try:
            return ModelConfig.from_hf(self.config)
        except ConfigError as exc:
            raise ConfigError(f"{self.path / 'config.json'}: {exc}") from None

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
            try:
                return self._load_bin(file)[name]
            except KeyError:
                raise CheckpointError(f"{file}: tensor {name!r} is listed in the index but not in the file") from None
        from safetensors import safe_open
        try:
            with safe_open(str(file), framework="pt") as f:
                return f.get_tensor(name)
        except Exception as exc:
            raise CheckpointError(f"{file}: cannot read tensor {name!r} ({exc})") from None

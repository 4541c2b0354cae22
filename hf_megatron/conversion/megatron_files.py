"""Megatron-LM checkpoint folder names, atomic writes and safe loading of `.pt` files.

    <root>/latest_checkpointed_iteration.txt      "100" (or "release")
    <root>/iter_0000100/mp_rank_TT[_PPP]/model_optim_rng.pt

`TT` is the tensor-parallel rank (2 digits), `PPP` the pipeline rank (3 digits), present only
when the pipeline size is > 1 (Megatron's rule).  A release checkpoint lives in `<root>/release`.

`safe_load` never runs pickled code: it loads with `weights_only=True` and allow-lists only
`argparse.Namespace` plus inert stand-ins for anything else a Megatron checkpoint pickles
(its enums, numpy RNG arrays, ...).  A stand-in keeps the constructor arguments and state it
was given (`.args`, `.state`) and does nothing else.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .hf_io import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"


def iter_dir_name(iteration: int | str) -> str:
    return "release" if iteration == "release" else f"iter_{int(iteration):07d}"


def rank_dir_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp_size > 1 else "")


def read_tracker(root: Path) -> int | str:
    tracker = root / TRACKER
    text = tracker.read_text().strip()
    if text == "release":
        return text
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{tracker}: expected an iteration number or 'release', got {text[:40]!r}") from None


def resolve_iteration_dir(path: str | os.PathLike, iteration: int | None = None) -> tuple[Path, int | str]:
    """(iteration folder, iteration) from a checkpoint root (tracker file) or an iter_/release folder."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    if iteration is not None:
        folder = path / iter_dir_name(iteration)
    elif (path / TRACKER).is_file():
        iteration = read_tracker(path)
        folder = path / iter_dir_name(iteration)
    elif path.name == "release" or path.name.startswith("iter_"):
        folder, iteration = path, "release" if path.name == "release" else int(path.name[5:])
    else:
        raise CheckpointError(f"{path}: not a Megatron checkpoint (no {TRACKER} and not an iter_* folder)")
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: iteration folder missing (tracker says {iteration})")
    return folder, iteration


def saved_layout(iter_dir: Path) -> tuple[int, int]:
    """(tp, pp) implied by the mp_rank_TT[_PPP] folder names (0, 0 when there are none)."""
    tps, pps = set(), set()
    for d in iter_dir.glob("mp_rank_*"):
        parts = d.name.split("_")[2:]
        if d.is_dir() and all(p.isdigit() for p in parts):
            tps.add(int(parts[0]))
            pps.add(int(parts[1]) if len(parts) > 1 else 0)
    return (max(tps) + 1 if tps else 0), (max(pps) + 1 if pps else 0)


def write_text_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_atomic(obj, path: Path) -> None:
    """torch.save to a temporary name in the same folder, then rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class StagingDir:
    """Build an output folder under a hidden temporary name; `commit()` renames it into place.

    A crash before `commit()` leaves only `.<name>.partial-*`, never a folder that looks done."""

    def __init__(self, final: str | os.PathLike, allow_existing: bool = False):
        self.final = Path(final)
        if self.final.exists() and not allow_existing and any(self.final.iterdir()):
            raise CheckpointError(f"{self.final}: output folder exists and is not empty; remove it or pick another")
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.path = Path(tempfile.mkdtemp(dir=self.final.parent, prefix=f".{self.final.name}.partial-"))

    def commit(self) -> Path:
        if self.final.exists():
            shutil.rmtree(self.final)
        os.replace(self.path, self.final)
        return self.final

    def abort(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> "StagingDir":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


# ------------------------------------------------------------------ safe unpickling

class _Inert:
    """Stand-in for a class or function we refuse to import while unpickling."""
    _qualified_name = "?"

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.state = state

    @property
    def value(self):  # enum members pickle as EnumClass(value)
        return self.args[0] if self.args else None

    def __repr__(self) -> str:
        return f"<{self._qualified_name}{self.args!r}>"


def _stand_in(qualified_name: str) -> type:
    return type(qualified_name.rsplit(".", 1)[-1], (_Inert,), {"_qualified_name": qualified_name})


def safe_load(path, mmap: bool = False):
    """torch.load(weights_only=True) with argparse.Namespace allowed and inert stand-ins for the
    rest.  `path`: a file path, or a seekable binary stream (then `mmap` is ignored)."""
    is_stream = hasattr(path, "read")
    where = "<stream>" if is_stream else str(path)
    if not is_stream and not Path(path).is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path if is_stream else str(path))
    except Exception as exc:
        raise CheckpointError(f"{where}: truncated or not a torch checkpoint ({_first_line(exc)})") from None
    if is_stream:
        path.seek(0)
    allowed: list = [argparse.Namespace]
    allowed += [(_stand_in(name), name) for name in unsafe if name != "argparse.Namespace"]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path if is_stream else str(path), map_location="cpu", weights_only=True,
                              mmap=mmap and not is_stream)
    except Exception as exc:
        raise CheckpointError(f"{where}: truncated or corrupt checkpoint file ({_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"

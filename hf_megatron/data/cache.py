"""Build-once index caching: rank 0 computes and saves, every rank then memory-maps the .npy files.

Files are named ``{md5(description)}-{kind}-{split}-{array}.npy`` next to a
``...-description.json`` holding the description itself, so any change of the inputs (data
files, split, seed, sequence length, sample counts) yields a new hash and a rebuild, and a reused
cache can be audited.  Writes are atomic (temp + rename) with the description written last: a
description file on disk means all arrays are complete.  A cached array that does not load as a
.npy file, or that the caller's ``check`` finds of the wrong dtype, shape or value range (a damaged
or foreign file under that name), is a DataError naming it: it is never used, and never silently
rebuilt over (another rank may be reading it).
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Callable

import numpy as np

from ..errors import ConfigError, DataError, DataNotFoundError

CACHE_FORMAT = 1


def description_hash(description: dict) -> str:
    text = json.dumps(description, indent=2, sort_keys=True)
    return hashlib.md5(text.encode("utf-8")).hexdigest()


def check_output_folder(flag: str, value: str | os.PathLike, folder: str | os.PathLike | None = None) -> None:
    """`folder` (default: `value`, the flag's value) is where a command will create or write files
    (--output-prefix's folder, --tensorboard-dir, --data-cache-path): a ConfigError naming the flag
    and its value when a file stands on the way or it cannot be written, before any expensive work."""
    path = os.path.abspath(value if folder is None else folder)
    probe = path
    while not os.path.exists(probe):  # the first part of the path that exists
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ConfigError(f"{flag} {value}: expected a folder{' path' if folder is not None else ''}, "
                          f"{probe} is a file")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {value}: cannot write into {probe} (permission denied)")


def _dist_rank() -> tuple[bool, int]:
    try:
        import torch.distributed as dist
    except ImportError:  # torch without distributed support
        return False, 0
    if dist.is_available() and dist.is_initialized():
        return True, dist.get_rank()
    return False, 0


def _save_atomic(path: str, array: np.ndarray) -> None:
    tmp = f"{path}.tmp{os.getpid()}.npy"
    np.save(tmp, array, allow_pickle=False)
    os.replace(tmp, path)


def index_problem(array: np.ndarray, low: int, high: int, shape: tuple) -> str | None:
    """None when `array` is an integer array of `shape` (None = any length) with every value in
    [low, high); else what was expected and what was found (for a damaged cache file's error)."""
    wanted = "[" + ", ".join("N" if n is None else str(n) for n in shape) + "]"
    expected = f"expected integers of shape {wanted} in [{low}, {high})"
    if array.dtype.kind not in "iu" or array.ndim != len(shape) or any(
            n is not None and n != m for n, m in zip(shape, array.shape)):
        return f"{expected}, found {array.dtype.name} of shape {list(array.shape)}"
    if array.size and (int(array.min()) < low or int(array.max()) >= high):
        return f"{expected}, found values {int(array.min())}..{int(array.max())}"
    return None


def _load_cached(path: str) -> np.ndarray:
    try:
        with open(path, "rb") as stream:
            magic = stream.read(6)
        if magic != b"\x93NUMPY":
            raise ValueError("not a .npy file")
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"{path}: damaged index cache file ({reason}); expected the .npy array hf_megatron "
                        "wrote there -- delete it to rebuild") from None


def cached_arrays(cache_dir: str | None, kind: str, split: str, description: dict,
                  names: tuple[str, ...], build: Callable[[], tuple[np.ndarray, ...]],
                  check: Callable[[tuple[np.ndarray, ...]], tuple[int, str] | None] | None = None
                  ) -> tuple[tuple[np.ndarray, ...], str]:
    """Return the arrays ``names`` (built by ``build()`` on rank 0 unless already cached) and the
    description hash.  With ``cache_dir=None`` every rank builds in memory and nothing is saved.
    ``check(arrays)`` vets arrays read from the cache: None, or (position in ``names``, what was
    expected and found), which is raised as a DataError naming that file."""
    description = {"format": CACHE_FORMAT, **description}
    digest = description_hash(description)
    if cache_dir is None:
        return tuple(build()), digest
    base = os.path.join(cache_dir, f"{digest}-{kind}-{split}")
    paths = [f"{base}-{name}.npy" for name in names]
    desc_path = f"{base}-description.json"
    distributed, rank = _dist_rank()
    hit = os.path.isfile(desc_path) and all(os.path.isfile(p) for p in paths)
    built = None
    if not hit and rank == 0:
        os.makedirs(cache_dir, exist_ok=True)
        built = tuple(build())
        for path, array in zip(paths, built):
            _save_atomic(path, array)
        tmp = f"{desc_path}.tmp{os.getpid()}"
        with open(tmp, "w") as out:
            json.dump(description, out, indent=2, sort_keys=True)
        os.replace(tmp, desc_path)
    if distributed:
        import torch.distributed as dist
        dist.barrier()  # always (a rank's own hit/miss may race with rank 0's writes)
    if built is not None:
        return built, digest
    missing = [p for p in [desc_path, *paths] if not os.path.isfile(p)]
    if missing:
        raise DataNotFoundError(f"{missing[0]}: index cache file missing after rank 0 built it "
                                "(is the cache directory, --data-cache-path, shared by all ranks?)")
    arrays = tuple(_load_cached(p) for p in paths)
    problem = check(arrays) if check is not None else None
    if problem is not None:
        position, what = problem
        raise DataError(f"{paths[position]}: damaged index cache file ({what}); delete it to rebuild")
    return arrays, digest

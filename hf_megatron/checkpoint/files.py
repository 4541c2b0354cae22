"""Megatron-LM checkpoint folder names, atomic writes, staging.

    <root>/latest_checkpointed_iteration.txt      "100" (or "release"), written last
    <root>/iter_0000100/mp_rank_TT[_PPP]/model_optim_rng.pt
    <root>/iter_0000100/mp_rank_TT[_PPP]/optim_dp_RRR.pt     (per-dp-rank optimizer state)

`TT` is the tensor-parallel rank (2 digits), `PPP` the pipeline rank (3 digits), present only
when the pipeline size is > 1 (Megatron's rule).  A release checkpoint lives in `<root>/release`.

Every folder is built under a hidden staging name and put in place by one rename
(`StagingDir`); an existing folder of the same name is swapped out atomically
(renameat2 RENAME_EXCHANGE where the OS has it), so a reader -- and the tracker file, which
names an iteration only after its folder is in place -- never sees a missing or half folder.
"""
from __future__ import annotations

import ctypes
import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

import torch

from ..errors import CheckpointError, HFMegatronError
from .checksums import checksum_missing_files, sidecar, write_checksum

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"


def iter_dir_name(iteration: int | str) -> str:
    return "release" if iteration == "release" else f"iter_{int(iteration):07d}"


def rank_dir_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp_size > 1 else "")


def optim_file_name(dp_rank: int) -> str:
    return f"optim_dp_{dp_rank:03d}.pt"


def within(path: str | os.PathLike, root: str | os.PathLike, action: str = "read") -> Path:
    """`path`, checked to stay inside `root` once symlinks are followed (a symlink within the folder
    is fine): a folder handed to us must not make us read, copy or upload a file from elsewhere."""
    path = Path(path)
    target, root = path.resolve(), Path(root).resolve()
    if not target.is_relative_to(root):
        how = "leads to" if os.path.normpath(path.absolute()) == str(target) else "a symlink to"  # `..` or a link
        raise CheckpointError(f"{path}: {how} {target}, outside {root}; refusing to {action} it")
    return path


def check_links_within(folder: str | os.PathLike, root: str | os.PathLike, action: str = "read") -> None:
    """Every symlink under `folder` (the folder itself included) stays inside `root` (see `within`)."""
    within(folder, root, action)
    for parent, dirs, files in os.walk(folder):  # does not descend into linked folders: checked here
        for name in dirs + files:
            entry = Path(parent) / name
            if entry.is_symlink():
                within(entry, root, action)


def read_tracker(root: Path) -> int | str:
    tracker = within(root / TRACKER, root)
    text = tracker.read_text().strip()
    if text == "release":
        return text
    if text.isdigit():  # a plain non-negative number (no sign, no spaces inside)
        return int(text)
    raise CheckpointError(f"{tracker}: expected an iteration number or 'release', got {text[:40]!r}")


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
    elif path.name == "release" or (path.name.startswith("iter_") and path.name[5:].isdigit()):
        folder, iteration = path, "release" if path.name == "release" else int(path.name[5:])
    else:
        raise CheckpointError(f"{path}: not a Megatron checkpoint (no {TRACKER} and not an iter_* folder)")
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: iteration folder missing (tracker says {iteration})")
    # the checkpoint root (the tracker's folder) bounds where the rank files may live
    check_links_within(folder, folder.parent if (folder.parent / TRACKER).is_file() else folder)
    return folder, iteration


def saved_layout(iter_dir: Path) -> tuple[int, int]:
    """(tp, pp) implied by the mp_rank_TT[_PPP] folder names (0, 0 when there are none); a _PPP
    suffix means pp > 1 even when only stage 0's folders are left."""
    tps, pps, staged = set(), set(), False
    for d in iter_dir.glob("mp_rank_*"):
        parts = d.name.split("_")[2:]
        if d.is_dir() and parts and all(p.isdigit() for p in parts):
            tps.add(int(parts[0]))
            pps.add(int(parts[1]) if len(parts) > 1 else 0)
            staged = staged or len(parts) > 1
    pp = max(pps) + 1 if pps else 0
    return (max(tps) + 1 if tps else 0), (max(pp, 2) if staged else pp)


# ------------------------------------------------------------------ atomic writes

def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # e.g. Windows: directories cannot be opened
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def current_umask() -> int:
    """The process's umask, read without changing it where Linux tells (/proc), else by the
    set-and-restore dance."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def honour_umask(path: Path) -> None:
    """Give a file a writer made 0600 (mkstemp, safetensors) the mode open() would have given it."""
    os.chmod(path, 0o666 & ~current_umask())


def _write_atomic(path: Path, write) -> None:
    """write(temporary path in the same folder), then rename it to `path`.  mkstemp makes the
    file 0600; it gets the mode a plain open() would have given it (0666 less the umask)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
    finally:
        os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    _write_atomic(path, write)
    _fsync_dir(path.parent)


def save_atomic(obj, path: Path) -> None:
    """torch.save `obj` to `path` atomically, with its sha256 sidecar (checksums.py).  An old
    sidecar goes first: a crash in between leaves a file without one, never a false mismatch."""
    sidecar(path).unlink(missing_ok=True)
    _write_atomic(path, lambda tmp: torch.save(obj, tmp))
    write_checksum(path)


try:
    _renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
except (AttributeError, OSError, TypeError):  # not Linux/glibc
    _renameat2 = None
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one step; False where the OS or filesystem cannot."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def replace_dir(new: Path, final: Path) -> None:
    """Put folder `new` at `final`.  An existing `final` is swapped out in one step and then
    removed, so `final` is never missing; where the OS cannot swap, the old folder is moved
    aside first (a window of one rename)."""
    if not final.exists():
        os.replace(new, final)
    elif _exchange(new, final):
        shutil.rmtree(new)
    else:
        aside = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.old-"))
        os.replace(final, aside / final.name)
        os.replace(new, final)
        shutil.rmtree(aside)
    _fsync_dir(final.parent)


class StagingDir:
    """Build an output folder under a hidden name; `commit()` puts it in place atomically.

    A crash before `commit()` leaves only `.<name>.partial-*`, never a folder that looks done.
    `shared=True` gives every process the same name (`.<name>.partial-shared`), so ranks of a
    distributed save write into one folder; only the process with `create=True` makes it
    (clearing what a crashed save left) and should commit it."""

    def __init__(self, final: str | os.PathLike, allow_existing: bool = False, shared: bool = False,
                 create: bool = True):
        self.final = Path(final)
        if self.final.exists() and not self.final.is_dir():
            raise CheckpointError(f"{self.final}: is a file, not a folder; the output must be a new or empty folder")
        if self.final.exists() and not allow_existing and any(self.final.iterdir()):
            raise CheckpointError(f"{self.final}: output folder exists and is not empty; remove it or pick another")
        try:
            self._make(shared, create)
        except OSError as exc:
            raise _cannot_write(self.final, exc) from exc

    def _make(self, shared: bool, create: bool) -> None:
        if not shared:
            self.final.parent.mkdir(parents=True, exist_ok=True)
            self.path = Path(tempfile.mkdtemp(dir=self.final.parent, prefix=f".{self.final.name}.partial-"))
            os.chmod(self.path, 0o777 & ~current_umask())  # mkdtemp's 0700 would become the output's mode
            return
        self.path = self.final.parent / f".{self.final.name}.partial-shared"
        if create:
            self.final.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(self.path, ignore_errors=True)
            self.path.mkdir()

    def commit(self) -> Path:
        checksum_missing_files(self.path)  # e.g. torch_dist's .distcp files; in place before the rename
        replace_dir(self.path, self.final)
        return self.final

    def abort(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> "StagingDir":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
            if isinstance(exc, OSError) and not isinstance(exc, HFMegatronError):
                raise _cannot_write(self.final, exc) from exc  # disk full, permissions: one line, nothing left


def _cannot_write(final: Path, exc: OSError) -> CheckpointError:
    where = f" ({exc.filename})" if exc.filename else ""
    return CheckpointError(f"{final}: cannot write the output: {exc.strerror or exc}{where}")


# ------------------------------------------------------------------ copying side files

def copy_files_within(source: Path, out_dir: Path, names: Iterable[str], root: Path | None = None) -> list[str]:
    """Copy those of `names` that are files in `source` to `out_dir`; returns the names copied.
    A file that is a symlink resolving outside `root` (default: `source` itself) is refused:
    a folder handed to us must not make us copy (or upload) a file from elsewhere."""
    copied = []
    for name in names:
        file = source / name
        if not file.is_file():
            continue
        target = within(file, root or source, "copy").resolve()
        shutil.copyfile(target, out_dir / name)  # the content only: the new file's mode follows the umask
        copied.append(name)
    return copied

"""One training run per --save folder: `<save>/.hf_megatron.lock`, held with flock(2) for the run.

Two runs writing one folder would interleave their checkpoints and trackers.  The lock is an
advisory exclusive flock on a small file in the folder; the kernel drops it when its holder
exits however it exits (SIGKILL included), so a lock left by a dead process is simply taken
over -- the file's text (pid, host) only serves the error message of a second writer.  The
file is kept while the folder holds anything else: unlinking it could let a starting run lock a
fresh inode beside it.  A run that stops having written nothing (an error, nothing to train) leaves
no trace: the lock file it created goes, and the folder too when the run created it.
Under torch.distributed only global rank 0 takes the lock; every rank gets the verdict.

Holding the lock also means no live run is writing the folder, so what an interrupted save left
there -- a staging folder `.iter_NNNNNNN.partial-*` (checkpoint/files.py's StagingDir) or a
tracker's temporary `.latest_checkpointed_iteration.txt.*`, which a SIGKILL or a crashed machine
leaves behind since no handler runs -- is removed when the lock is taken; `cleared` names it.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
from pathlib import Path

import torch.distributed as dist

from ..errors import CheckpointError

LOCK_FILE = ".hf_megatron.lock"
# what checkpoint/files.py writes under a hidden name before renaming it into place
UNFINISHED = re.compile(r"\.(iter_\d{7}|release)\.partial-.+|\.latest_checkpointed_iteration\.txt\..+")


def clear_unfinished(folder: Path) -> list[str]:
    """Remove the staging folders and temporary tracker files an interrupted save left in `folder`
    (top level only); their names, sorted.  Call only while holding the folder's lock."""
    cleared = []
    for path in sorted(folder.iterdir()):
        if not UNFINISHED.fullmatch(path.name) or path.is_symlink():
            continue
        try:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        except OSError:
            continue
        cleared.append(path.name)
    return cleared


class SaveLock:
    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder, self.path, self._fd = Path(folder), Path(folder) / LOCK_FILE, None
        self.cleared: list[str] = []  # what an interrupted save had left (clear_unfinished)
        self._created: list[Path] = []  # what _try made: the lock file, then the folder(s) it needed

    def _try(self) -> str | None:
        """Take the lock; the reason it is not free, or None."""
        import fcntl
        if self.folder.exists() and not self.folder.is_dir():
            return f"--save {self.folder}: expected a folder, found a file"
        missing = [p for p in (self.folder, *self.folder.parents) if not p.exists()]
        existed = self.path.exists()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            self._created = ([] if existed else [self.path]) + missing
        except OSError as exc:
            return f"--save {self.folder}: cannot create the lock file ({exc.strerror})"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "unknown process"
            os.close(fd)
            return (f"--save {self.folder}: in use by another training run ({holder}; lock {self.path}); "
                    "wait for it to finish or give another --save folder")
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
        self._fd = fd
        try:
            self.cleared = clear_unfinished(self.folder)
        except OSError:
            self.cleared = []
        return None

    def acquire(self) -> "SaveLock":
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        verdict = [self._try() if not distributed or dist.get_rank() == 0 else None, self.cleared]
        if distributed:
            dist.broadcast_object_list(verdict, src=0)
        if verdict[0]:
            raise CheckpointError(verdict[0])
        self.cleared = verdict[1]
        return self

    def release(self, remove_if_unused: bool = False) -> None:
        """Drop the lock; `remove_if_unused`: also remove the lock file and the folders this lock made
        for it when nothing else was written there (a run that failed or had nothing to train)."""
        if self._fd is None:
            return
        if remove_if_unused and self._created and self._created[0] == self.path and self._only_the_lock():
            for made in self._created:  # still holding the flock: the lock file, then the folders made for it
                try:
                    made.unlink() if made == self.path else made.rmdir()
                except OSError:
                    break
        os.close(self._fd)  # closing drops the flock
        self._fd = None

    def _only_the_lock(self) -> bool:
        try:
            return [p.name for p in self.folder.iterdir()] == [LOCK_FILE]
        except OSError:
            return False

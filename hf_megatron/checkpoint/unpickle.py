"""Unpickling checkpoint files without ever running code named in them.

A pickle names the classes and functions it needs as (module, qualified name) and the loader
calls them; a hostile file names `os.system`, or reaches it through a dotted path
(`some.allowed.module` + `os.system`).  Every unpickler here therefore resolves a name only by
an exact lookup in a table of (module, qualified name) -> object built in this file; nothing
is ever imported or looked up by attribute, no prefix of a module admits anything, and a name
not in the table is refused with a one-line CheckpointError.

Three tables:

    REAL       types we let a checkpoint construct (argparse.Namespace, ...): inert containers
    STAND_INS  types Megatron-LM / megatron-core files pickle (their enums, numpy RNG arrays,
               OptimizerConfig) that we do not need: each loads as an inert `_Inert` subclass
               that keeps its constructor arguments (`.args`) and state (`.state`), no more
    torch      torch's own weights_only table (tensors, storages, dtypes, OrderedDict, ...)

`safe_load` reads torch files (`model_optim_rng.pt`, `optim_dp_*.pt`, `common.pt`, DCP byte
entries) with `torch.load(weights_only=True)` and exactly REAL + STAND_INS allowed;
process-wide additions other libraries make to torch's safe globals (megatron-core registers
its own) are set aside while it runs (`own_safe_globals`, also around DCP's tensor reads).  `AllowListUnpickler` is a plain pickle.Unpickler over
an explicit table (torch_dist's `.metadata`).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import pathlib
import pickle
import signal
import types
from pathlib import Path
from typing import Iterable, Iterator

import torch

from ..errors import CheckpointError
from .checksums import verify_checksum


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


def stand_in(module: str, qualname: str) -> type:
    """A fresh inert class standing for `module.qualname`."""
    return type(qualname.rsplit(".", 1)[-1], (_Inert,), {"_qualified_name": f"{module}.{qualname}"})


REAL: dict[tuple[str, str], object] = {
    ("argparse", "Namespace"): argparse.Namespace,
    ("types", "SimpleNamespace"): types.SimpleNamespace,
    **{(module, cls): getattr(pathlib, cls)  # pathlib._local: how Python >= 3.13 names them
       for module in ("pathlib", "pathlib._local") for cls in ("PosixPath", "PurePosixPath")},
    ("_io", "BytesIO"): io.BytesIO,
    ("signal", "Signals"): signal.Signals,
}

# what Megatron-LM and megatron-core pickle into their files (megatron/core/safe_globals.py and
# the enums of older releases); names only, never imported
STAND_INS: frozenset[tuple[str, str]] = frozenset({
    ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.dtypes", "UInt32DType"),
    ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "_reconstruct"),
    ("megatron.core.enums", "ModelType"), ("megatron.core.transformer.enums", "ModelType"),
    ("megatron.core.transformer.enums", "AttnBackend"), ("megatron.core.transformer.enums", "AttnMaskType"),
    ("megatron.core.transformer.enums", "AttnType"), ("megatron.core.transformer.enums", "LayerType"),
    ("megatron.core.transformer.enums", "CudaGraphScope"),
    ("megatron.core.optimizer.optimizer_config", "OptimizerConfig"),
    ("megatron.core.rerun_state_machine", "RerunDiagnostic"), ("megatron.core.rerun_state_machine", "RerunMode"),
    ("megatron.core.rerun_state_machine", "RerunState"),
    ("megatron.model.enums", "AttnMaskType"), ("megatron.model.enums", "AttnType"),
    ("megatron.model.enums", "LayerType"), ("megatron.model.enums", "ModelType"),
})


def refusal(where: str, module: str, name: str) -> CheckpointError:
    return CheckpointError(f"{where}: refusing to unpickle {module}.{name} (not on hf_megatron's allow-list of "
                           f"checkpoint types; nothing named in a checkpoint is ever imported)")


class AllowListUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves (module, qualified name) only through `allowed`."""

    def __init__(self, file, allowed: dict[tuple[str, str], object], where: str):
        super().__init__(file)
        self.allowed, self.where = allowed, where

    def find_class(self, module: str, name: str):
        try:
            return self.allowed[(module, name)]
        except (KeyError, TypeError):
            raise refusal(self.where, str(module), str(name)) from None

    def persistent_load(self, pid):
        raise CheckpointError(f"{self.where}: unexpected persistent id in a checkpoint pickle")


def load_pickle(file, allowed: dict[tuple[str, str], object], where: str):
    """Unpickle `file` (binary stream) with exactly `allowed`; any failure is one CheckpointError."""
    try:
        return AllowListUnpickler(file, allowed, where).load()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{where}: not a loadable pickle (corrupt or unsupported: {first_line(exc)})") from None


@contextlib.contextmanager
def own_safe_globals() -> Iterator[None]:
    """torch's safe-globals set is process-wide (other libraries add to it; megatron-core does):
    set it aside, so that only torch's defaults and what we add inside hold while we load."""
    saved = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(saved)


def _table(stand_ins: Iterable[tuple[str, str]]) -> dict[str, tuple[str, str]]:
    """'module.qualname' (the key torch's unpickler looks up) -> (module, qualname)."""
    return {f"{m}.{n}": (m, n) for m, n in (*REAL, *STAND_INS, *stand_ins)}


def safe_load(path, mmap: bool = False, stand_ins: Iterable[tuple[str, str]] = ()):
    """torch.load(weights_only=True) of a checkpoint file with REAL + STAND_INS (+ `stand_ins`,
    exact (module, qualified name) pairs a caller knows to be data) allowed, nothing else.
    `path`: a file path, or a seekable binary stream (then `mmap` is ignored)."""
    is_stream = hasattr(path, "read")
    where = "<stream>" if is_stream else str(path)
    if not is_stream and not Path(path).is_file():
        raise CheckpointError(f"{path}: missing")
    if not is_stream:
        verify_checksum(Path(path))  # a flipped byte is refused before anything is unpickled
    source = path if is_stream else str(path)
    table = _table(stand_ins)
    with own_safe_globals():
        try:
            named = torch.serialization.get_unsafe_globals_in_checkpoint(source)
        except Exception as exc:
            raise CheckpointError(f"{where}: not a loadable torch checkpoint (truncated, corrupt or unsupported: "
                                  f"{first_line(exc)})") from None
        allowed = []
        for full in named:  # torch looks these up as 'module.name' strings: exact entries only
            if full not in table:
                module, _, name = full.rpartition(".")
                raise refusal(where, module, name)
            pair = table[full]
            allowed.append((REAL[pair] if pair in REAL else stand_in(*pair), full))
        if is_stream:
            path.seek(0)
        torch.serialization.add_safe_globals(allowed)
        try:
            return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap and not is_stream)
        except Exception as exc:
            raise CheckpointError(f"{where}: not a loadable torch checkpoint (truncated or corrupt: "
                                  f"{first_line(exc)})") from None


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"

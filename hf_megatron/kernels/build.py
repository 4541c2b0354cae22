"""Build-on-first-use of the CUDA extension in `csrc/` (torch.utils.cpp_extension.load + ninja).

The sources are found through the package: `hf_megatron/csrc/` in an installed wheel (the top-level
csrc/ shipped as package data, see pyproject.toml), else the repository's `csrc/` beside
`hf_megatron/` (a checkout or an editable install).  Nothing is compiled at install time.

The first call to `load_extension()` in a process compiles (or finds already compiled) the
sources into a per-environment cache folder:

    $TORCH_EXTENSIONS_DIR/hf_megatron_kernels_<tag>   when TORCH_EXTENSIONS_DIR is set
    ~/.cache/hf_megatron/hf_megatron_kernels_<tag>    otherwise

with <tag> = python, torch and CUDA versions and the GPU architectures, so switching
environments or GPU types never loads a stale binary; torch's own source hashing rebuilds when a file in csrc/ changes, and its lock file
keeps concurrent ranks from building at once.  `HF_MEGATRON_KERNELS=0` switches the kernels off.
A failed build warns once and the process keeps using the PyTorch fallbacks.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import sys
import threading
import warnings
from pathlib import Path

import torch

EXTENSION_NAME = "hf_megatron_kernels"
ENV_SWITCH = "HF_MEGATRON_KERNELS"
def csrc_directory() -> Path:
    """The folder holding bindings.cpp: the installed package's csrc/, else the source tree's."""
    package = Path(__file__).resolve().parents[1]
    for candidate in (package / "csrc", package.parent / "csrc"):
        if (candidate / "bindings.cpp").is_file():
            return candidate
    return package / "csrc"  # neither: _build names the missing files


CSRC = csrc_directory()

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_extension = None
_failed = False


def enabled() -> bool:
    """False when the user set HF_MEGATRON_KERNELS to 0/false/off/no."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def source_files() -> list[Path]:
    """The translation units: every csrc/*.cu (nvcc) and bindings.cpp (host compiler)."""
    return sorted(CSRC.glob("*.cu")) + [CSRC / "bindings.cpp"]


def _headers_digest() -> str:
    """Hash of the csrc/ headers, passed as a define: torch hashes only the listed sources and flags."""
    digest = hashlib.sha256()
    for header in sorted([*CSRC.glob("*.cuh"), *CSRC.glob("*.h")]):
        digest.update(header.read_bytes())
    return digest.hexdigest()[:16]


def _arch_tag() -> str:
    """GPU targets the build compiles for: TORCH_CUDA_ARCH_LIST, else the visible devices' (what
    cpp_extension does); in the folder name so a cache shared by A100 and H100 nodes keeps both."""
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if arch_list:
        return "sm" + "-".join(sorted(set(re.findall(r"[\w.+]+", arch_list)))).replace(".", "").replace("+", "")
    if torch.cuda.is_available():
        capabilities = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
        return "sm" + "-".join(f"{major}{minor}" for major, minor in sorted(capabilities))
    return "nogpu"


def build_directory() -> Path:
    tag = (f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__.split('+')[0]}"
           f"_cu{(torch.version.cuda or 'none').replace('.', '')}_{_arch_tag()}")
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "hf_megatron"
    return Path(root) / f"{EXTENSION_NAME}_{tag}"


def _build():
    from torch.utils.cpp_extension import load

    if torch.version.hip is not None:  # the block reductions assume 32-lane warps
        raise RuntimeError("ROCm builds of torch are not supported by csrc/")
    missing = [str(p) for p in source_files() if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"CUDA sources not found: {', '.join(missing)} "
                                f"(a wheel ships them in hf_megatron/csrc/, a checkout in csrc/)")
    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    logger.info("loading hf_megatron fused kernels from %s (compiled on first use)", directory)
    return load(
        name=EXTENSION_NAME,
        sources=[str(p) for p in source_files()],
        build_directory=str(directory),
        extra_include_paths=[str(CSRC)],
        extra_cflags=["-O3"],
        # no --use_fast_math: the kernels reproduce PyTorch's exp/divide/rsqrt results
        extra_cuda_cflags=["-O3", "-lineinfo", f"-DHF_MEGATRON_HEADERS={_headers_digest()}"],
        verbose=os.environ.get("HF_MEGATRON_KERNELS_VERBOSE", "0") == "1",
    )


def loaded() -> bool:
    """Whether this process has already tried `load_extension` (the module is loaded, or the build
    failed): the next call then only returns what it found, with no file access."""
    return _extension is not None or _failed


def load_extension():
    """The compiled module, or None (disabled, no CUDA, or the build failed: warned once)."""
    global _extension, _failed
    if _extension is not None or _failed:
        return _extension
    with _lock:
        if _extension is not None or _failed:
            return _extension
        try:
            _extension = _build()
        except Exception as err:  # any build/import failure means "use the fallbacks"
            _failed = True
            first_line = (str(err).strip().splitlines() or [""])[0]
            warnings.warn(f"hf_megatron: fused CUDA kernels unavailable, using PyTorch fallbacks "
                          f"({type(err).__name__}: {first_line})", RuntimeWarning, stacklevel=3)
    return _extension


def reset_for_tests() -> None:
    """Forget a loaded module or a recorded failure (tests only)."""
    global _extension, _failed
    _extension, _failed = None, False

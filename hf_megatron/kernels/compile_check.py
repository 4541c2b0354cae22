"""Compile every csrc/ source without a GPU: `python -m hf_megatron.kernels.compile_check`.

Runs nvcc (`-c`, object files only, nothing is linked or loaded) on each .cu with torch's
include paths and the flags torch.utils.cpp_extension uses, and the host compiler on
bindings.cpp.  A CPU-only torch wheel ships the ATen/c10 CUDA headers except one generated
file, c10/cuda/impl/cuda_cmake_macros.h; when it is missing, a stand-in with the single define
that CUDA builds of torch put there is written to a temporary include folder.
`--arch sm_80` (default sm_90) picks the target; `--ptxas` prints registers and spills; file
names (`swiglu.cu bindings.cpp`) restrict the run to those sources.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch
from torch.utils import cpp_extension

from .build import CSRC, source_files


def _cxx_standard() -> str:
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    return "-std=c++20" if (major, minor) >= (2, 10) else "-std=c++17"


def _shim_includes(folder: Path) -> list[str]:
    for root in cpp_extension.include_paths():
        if (Path(root) / "c10/cuda/impl/cuda_cmake_macros.h").is_file():
            return []
    shim = folder / "c10/cuda/impl/cuda_cmake_macros.h"
    shim.parent.mkdir(parents=True)
    shim.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    return [f"-I{folder}"]


def compile_all(arch: str = "sm_90", ptxas: bool = False, only: list[str] | None = None) -> int:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("nvcc not found on PATH", file=sys.stderr)
        return 2
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        includes = _shim_includes(Path(tmp) / "shim") + [f"-I{p}" for p in cpp_extension.include_paths()]
        includes.append(f"-I{CSRC}")
        cuda_sources = [p for p in source_files() if p.suffix == ".cu"]
        for source in cuda_sources:
            if only and source.name not in only:
                continue
            cmd = [nvcc, _cxx_standard(), f"-arch={arch}", "-O3", "-c", str(source), "-o",
                   str(Path(tmp) / (source.stem + ".o")), *cpp_extension.COMMON_NVCC_FLAGS, *includes,
                   "-diag-suppress=3306", "-Xcompiler", "-Wno-c++20-extensions"]
            if ptxas:
                cmd += ["-Xptxas", "-v"]
            failures += _run(source.name, cmd)
        if only and "bindings.cpp" not in only:
            return 1 if failures else 0
        python_include = sysconfig.get_paths()["include"]
        cmd = ["c++", _cxx_standard(), "-O1", "-fsyntax-only", "-DTORCH_EXTENSION_NAME=hf_megatron_kernels",
               str(CSRC / "bindings.cpp"), *includes, f"-I{python_include}"]
        failures += _run("bindings.cpp", cmd)
    return 1 if failures else 0


def _run(label: str, cmd: list[str]) -> int:
    result = subprocess.run(cmd, capture_output=True, text=True)
    status = "ok" if result.returncode == 0 else "FAILED"
    print(f"{label}: {status}")
    output = (result.stdout + result.stderr).strip()
    if output and (result.returncode != 0 or "-v" in cmd):
        print(output)
    return int(result.returncode != 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--ptxas", action="store_true", help="print ptxas register/spill report")
    parser.add_argument("only", nargs="*", help="file names in csrc/ to compile (default: all)")
    args = parser.parse_args(argv)
    return compile_all(args.arch, args.ptxas, args.only)


if __name__ == "__main__":
    sys.exit(main())

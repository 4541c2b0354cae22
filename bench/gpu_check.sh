#!/usr/bin/env bash
# GPU check of the fused kernels: build the extension, run the kernel tests, then the benchmark.
# Usage (from anywhere, on a CUDA machine; the repo need not be installed):
#   bash bench/gpu_check.sh            # PYTHON=python3 by default
# The extension is cached under $TORCH_EXTENSIONS_DIR or ~/.cache/hf_megatron (first build ~1-3 min).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}

"$PYTHON" - <<'PY'
import time, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "|", torch.cuda.get_device_name(0))
from hf_megatron import kernels
start = time.time()
assert kernels.load_extension() is not None, "the extension did not build"
print(f"extension ready in {time.time() - start:.1f} s")
PY
"$PYTHON" -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernels_gpu.py
"$PYTHON" bench/bench_kernels.py "$@"

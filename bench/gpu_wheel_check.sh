#!/usr/bin/env bash
# The fused kernels from an installed wheel, on a GPU: build the wheel from this checkout, install it
# non-editable (`pip install --no-deps --target $SITE`), then from a folder outside the repo with
# PYTHONPATH=$SITE only: the extension must build from $SITE/hf_megatron/csrc (into a fresh
# TORCH_EXTENSIONS_DIR, so nothing cached is reused), the fused RMSNorm / SwiGLU / rotary Functions must
# actually run (not the PyTorch fallbacks), and values and grads must match hf_megatron.kernels.reference.
# Prints one table line; exit 0 only if every check passed.
# Usage (from anywhere, on a CUDA machine with torch, setuptools>=77 and ninja installed):
#   bash bench/gpu_wheel_check.sh          # PYTHON=python3 SITE=/tmp/whl_site by default
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
SITE=${SITE:-/tmp/whl_site}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export PYTHONUNBUFFERED=1

echo "== tools: $("$PYTHON" -c 'import sys, torch, setuptools; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "setuptools", setuptools.__version__)')"
echo "== wheel: building from a copy of $REPO in $WORK/src (the build writes build/ and *.egg-info)"
mkdir "$WORK/src"
cp -r "$REPO/pyproject.toml" "$REPO/README.md" "$REPO/hf_megatron" "$REPO/csrc" "$WORK/src/"
"$PYTHON" -m pip wheel "$WORK/src" --no-deps --no-build-isolation -q -w "$WORK/dist"
WHEEL=$(ls "$WORK"/dist/hf_megatron-*.whl)
echo "== install: $(basename "$WHEEL") -> $SITE (non-editable, --no-deps)"
rm -rf "$SITE"
"$PYTHON" -m pip install --no-deps -q --target "$SITE" "$WHEEL"
ls "$SITE/hf_megatron/csrc"

mkdir "$WORK/elsewhere"
cd "$WORK/elsewhere"
echo "== run: cwd $PWD, PYTHONPATH=$SITE, TORCH_EXTENSIONS_DIR=$WORK/extensions (first build ~1-3 min)"
env -u PYTHONHOME PYTHONPATH="$SITE" TORCH_EXTENSIONS_DIR="$WORK/extensions" HF_MEGATRON_KERNELS=1 \
    "$PYTHON" - "$SITE" "$WORK/extensions" <<'PY'
import os, sys, time
from pathlib import Path
import torch

site, extensions = sys.argv[1], sys.argv[2]
import hf_megatron
from hf_megatron import kernels
from hf_megatron.kernels import build, functions, ops, reference

assert hf_megatron.__file__.startswith(os.path.join(site, "hf_megatron") + os.sep), \
    f"imported {hf_megatron.__file__}, not the wheel in {site}"
assert build.CSRC == Path(site, "hf_megatron", "csrc"), f"csrc resolved to {build.CSRC}"
assert torch.cuda.is_available(), "no CUDA device"
start = time.time()
ext = kernels.load_extension()
assert ext is not None, "the extension did not build (see the warning above)"
build_s = time.time() - start
assert os.path.realpath(ext.__file__).startswith(os.path.realpath(extensions)), \
    f"extension loaded from {ext.__file__}, not built fresh in {extensions}"

calls = {}
for name in ("FusedRMSNorm", "FusedRotary"):  # count uses: a silent fallback fails the check
    fn = getattr(functions, name)
    original = fn.apply
    fn.apply = lambda *args, _original=original, _name=name: calls.update({_name: calls.get(_name, 0) + 1}) \
        or _original(*args)
_swiglu = ops.swiglu
ops.swiglu = lambda *args: calls.update({"swiglu": calls.get("swiglu", 0) + 1}) or _swiglu(*args)


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def value_and_grads(fn, inputs, probe):
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    out = fn(*leaves)
    return [out.detach(), *torch.autograd.grad((out * probe).sum(), [t for t in leaves if t.requires_grad])]


gen = torch.Generator(device="cuda").manual_seed(0)
rand = lambda *shape, dtype: torch.randn(*shape, generator=gen, device="cuda").to(dtype)
tokens, hidden, ffn, heads, head_dim = 512, 1024, 2048, 8, 128
tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
cells, failed = [], []
for dtype in (torch.float32, torch.bfloat16):
    pos = torch.arange(tokens, device="cuda").float()[None, :, None]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim))
    emb = torch.cat((pos * inv_freq, pos * inv_freq), -1)
    cases = {
        "rms_norm": (lambda x, w: kernels.rms_norm(x, w, 1e-5), lambda x, w: reference.rms_norm_reference(x, w, 1e-5),
                     [rand(tokens, hidden, dtype=dtype).requires_grad_(), (1 + 0.1 * rand(hidden, dtype=torch.float32))
                      .to(dtype).requires_grad_()], (tokens, hidden)),
        "swiglu": (kernels.swiglu, reference.swiglu_reference, [rand(tokens, 2 * ffn, dtype=dtype).requires_grad_()],
                   (tokens, ffn)),
        "rotary": (kernels.apply_rotary, reference.apply_rotary_reference,
                   [rand(1, heads, tokens, head_dim, dtype=dtype).requires_grad_(), emb.cos().to(dtype),
                    emb.sin().to(dtype)], (1, heads, tokens, head_dim)),
    }
    for op, (fused, eager, inputs, out_shape) in cases.items():
        probe = rand(*out_shape, dtype=dtype)
        err = max(rel_err(a, b) for a, b in zip(value_and_grads(fused, inputs, probe),
                                                 value_and_grads(eager, inputs, probe)))
        cells.append(f"{op} {str(dtype).split('.')[-1]} {err:.1e}")
        if err > tol[dtype]:
            failed.append(f"{op} {dtype}: rel err {err:.2e} > {tol[dtype]}")
torch.cuda.synchronize()
unused = [name for name in ("FusedRMSNorm", "swiglu", "FusedRotary") if not calls.get(name)]
if unused:
    failed.append(f"fell back to PyTorch for {unused}")
print(f"| wheel kernels | {torch.cuda.get_device_name()} | torch {torch.__version__} | built in {build_s:.0f} s from "
      f"{build.CSRC} | {' | '.join(cells)} | {'OK' if not failed else 'FAILED'} |")
if failed:
    sys.exit("gpu_wheel_check FAILED: " + "; ".join(failed))
PY
echo "== gpu_wheel_check: OK"

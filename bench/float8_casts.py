"""How much of a float8 linear's time is its casts and scales, at the Llama 1.2B's layer shapes (issue 14).

Sessions 12 and 20 put torchao's casts, scales and amax reductions at ~38 ms of the 1.2B's 206 ms float8
step.  Before building a float8 linear of our own (Transformer Engine's design: delayed scaling, so the
cast needs no amax pass first and the amax of this step rides along in the casting kernel), this
measures, for each linear of one layer (T = 8 x 2048 tokens), one forward + backward (the output
GEMM, dgrad and wgrad) as:

  bf16          three bf16 GEMMs (the default's linear)
  torchao       torchao's Float8Linear (tensorwise, hybrid: e4m3 X and W, e5m2 gradient), compiled:
                what `--fp8-format hybrid` runs today
  dynamic       the same recipe written out by hand, forward and backward compiled apart (as autograd
                splits them): amax, then cast; the input's cast redone in backward from the saved bf16
                input (torchao saves the high-precision input) -- checks that this bench models torchao
  delayed       scales from a previous step's amax: one pass over X writes X and X^T in float8 and
                this step's amax; one pass over the gradient writes G and G^T and its amax; the
                float8 X^T is saved for wgrad instead of bf16 X
  fused         current scaling (as torchao) with one Triton kernel per operand that reads it once and
                writes it in float8 in both layouts (Transformer Engine's cast_transpose): torch's amax
                pass, then the kernel -- what a fused cast kernel of our own would give
  fused-delayed the same kernel with a scale from an earlier amax, this step's amax taken in the kernel
                (atomic max): one read, two float8 writes per operand
  gemms         the three float8 GEMMs on ready float8 operands: the floor no casting scheme beats

Run on a GPU with float8 tensor cores (sm89+) and torchao importable:
    python bench/float8_casts.py [--tokens 16384] [--layers 16]
Prints ms per linear and per layer, and what `layers` layers would save per step.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}
SHAPES = {"qkv": (2048, 3072), "proj": (2048, 2048), "fc1": (2048, 16384), "fc2": (8192, 2048)}  # (in, out)


def _scale(amax: torch.Tensor, dtype) -> torch.Tensor:
    return (MAX[dtype] / amax.float().clamp(min=1e-12)).to(torch.float32)


def _cast(t: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    return (t.float() * scale).clamp(-MAX[dtype], MAX[dtype]).to(dtype)


def _mm(a, b_col_major, sa, sb):
    return torch._scaled_mm(a, b_col_major, scale_a=sa.reciprocal(), scale_b=sb.reciprocal(),
                            out_dtype=torch.bfloat16)


# ---- dynamic (current) scaling, torchao's tensorwise recipe written out ------------------------------
def dyn_forward(x, w):
    sx, sw = _scale(x.abs().amax(), E4M3), _scale(w.abs().amax(), E4M3)
    return _mm(_cast(x, sx, E4M3), _cast(w, sw, E4M3).t(), sx, sw)


def dyn_backward(x, w, g):
    sx, sw, sg = _scale(x.abs().amax(), E4M3), _scale(w.abs().amax(), E4M3), _scale(g.abs().amax(), E5M2)
    dx = _mm(_cast(g, sg, E5M2), _cast(w.t().contiguous(), sw, E4M3).t(), sg, sw)
    dw = _mm(_cast(g.t().contiguous(), sg, E5M2), _cast(x.t().contiguous(), sx, E4M3).t(), sg, sx)
    return dx, dw


# ---- delayed scaling: the scale comes in, this step's amax goes out ---------------------------------
def del_forward(x, w, sx, sw):
    xf, xtf = _cast(x, sx, E4M3), _cast(x.t(), sx, E4M3).contiguous()
    wf, wtf = _cast(w, sw, E4M3), _cast(w.t(), sw, E4M3).contiguous()
    return _mm(xf, wf.t(), sx, sw), xtf, wtf, x.abs().amax(), w.abs().amax()


def del_backward(g, xtf, wtf, sx, sw, sg):
    gf, gtf = _cast(g, sg, E5M2), _cast(g.t(), sg, E5M2).contiguous()
    return _mm(gf, wtf.t(), sg, sw), _mm(gtf, xtf.t(), sg, sx), g.abs().amax()


@functools.cache
def _cast_transpose_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, out_ptr, out_t_ptr, scale_ptr, amax_ptr, M, N, FMAX: tl.constexpr, BM: tl.constexpr,
               BN: tl.constexpr):
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        x = tl.load(x_ptr + rm[:, None] * N + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        y = tl.clamp(x * tl.load(scale_ptr), -FMAX, FMAX).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], y, mask=mask)
        tl.store(out_t_ptr + rn[:, None] * M + rm[None, :], tl.trans(y), mask=tl.trans(mask))
        tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(x), axis=1), axis=0))
    return kernel


def cast_transpose(x: torch.Tensor, scale: torch.Tensor, dtype, amax: torch.Tensor, block: int = 64):
    """x [M, N] bf16 -> (x * scale in `dtype` [M, N], its transpose [N, M] contiguous); amax <- max(amax, |x|)."""
    m, n = x.shape
    out, out_t = torch.empty(m, n, device=x.device, dtype=dtype), torch.empty(n, m, device=x.device, dtype=dtype)
    grid = (-(-m // block), -(-n // block))
    _cast_transpose_kernel()[grid](x, out, out_t, scale, amax, m, n, FMAX=MAX[dtype], BM=block, BN=block)
    return out, out_t


def _time(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def measure(tokens: int, k: int, n: int, warmup: int, iters: int) -> dict[str, float]:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(tokens, k, device=dev, dtype=bf16)
    w = (torch.randn(n, k, device=dev, dtype=bf16) / k ** 0.5)
    g = torch.randn(tokens, n, device=dev, dtype=bf16) * 1e-3
    out = {}

    out["bf16"] = _time(lambda: (x @ w.t(), g @ w, g.t() @ x), warmup, iters)

    lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=bf16)
    with torch.no_grad():
        lin.weight.copy_(w)
    convert_to_float8_training(lin, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    lin = torch.compile(lin)
    xg = x.detach().clone().requires_grad_(True)

    def torchao_step():  # dX and dW as the layer's backward gives them, no accumulation into .grad
        torch.autograd.grad(lin(xg), [xg, lin.weight], g)
    out["torchao"] = _time(torchao_step, warmup, iters)

    fwd, bwd = torch.compile(dyn_forward), torch.compile(dyn_backward)
    out["dynamic"] = _time(lambda: (fwd(x, w), bwd(x, w, g)), warmup, iters)

    sx, sw, sg = _scale(x.abs().amax(), E4M3), _scale(w.abs().amax(), E4M3), _scale(g.abs().amax(), E5M2)
    dfwd, dbwd = torch.compile(del_forward), torch.compile(del_backward)

    def delayed_step():
        _, xtf, wtf, *_ = dfwd(x, w, sx, sw)
        dbwd(g, xtf, wtf, sx, sw, sg)
    out["delayed"] = _time(delayed_step, warmup, iters)

    amaxes = torch.zeros(3, device=dev, dtype=torch.float32)

    def fused_step(delayed: bool):
        amaxes.zero_()
        scales = (sx, sw) if delayed else (_scale(x.abs().amax(), E4M3), _scale(w.abs().amax(), E4M3))
        xf_, xtf_ = cast_transpose(x, scales[0], E4M3, amaxes[0:1])
        wf_, wtf_ = cast_transpose(w, scales[1], E4M3, amaxes[1:2])
        _mm(xf_, wf_.t(), *scales)
        sg_ = sg if delayed else _scale(g.abs().amax(), E5M2)
        gf_, gtf_ = cast_transpose(g, sg_, E5M2, amaxes[2:3])
        return _mm(gf_, wtf_.t(), sg_, scales[1]), _mm(gtf_, xtf_.t(), sg_, scales[0])
    out["fused"] = _time(lambda: fused_step(False), warmup, iters)
    out["fused-delayed"] = _time(lambda: fused_step(True), warmup, iters)

    xf, wf = _cast(x, sx, E4M3), _cast(w, sw, E4M3)
    wtf, xtf = _cast(w.t().contiguous(), sw, E4M3), _cast(x.t().contiguous(), sx, E4M3)
    gf, gtf = _cast(g, sg, E5M2), _cast(g.t().contiguous(), sg, E5M2)
    out["gemms"] = _time(lambda: (_mm(xf, wf.t(), sx, sw), _mm(gf, wtf.t(), sg, sw), _mm(gtf, xtf.t(), sg, sx)),
                         warmup, iters)

    # the hand-written recipes compute what the GEMMs on ready operands compute
    y_ref, dx_ref, dw_ref = _mm(xf, wf.t(), sx, sw), _mm(gf, wtf.t(), sg, sw), _mm(gtf, xtf.t(), sg, sx)
    y_del, xtf2, wtf2, *_ = dfwd(x, w, sx, sw)
    dx_del, dw_del, _ = dbwd(g, xtf2, wtf2, sx, sw, sg)
    for a, b in ((y_del, y_ref), (dx_del, dx_ref), (dw_del, dw_ref)):
        torch.testing.assert_close(a, b)
    amax = torch.zeros(1, device=dev, dtype=torch.float32)  # does the Triton kernel cast as torch does?
    differ = 0
    for t, scale, dtype, (ref, ref_t) in ((x, sx, E4M3, (xf, xtf)), (g, sg, E5M2, (gf, gtf))):
        amax.zero_()
        got, got_t = cast_transpose(t, scale, dtype, amax)
        differ += int((got.view(torch.uint8) != ref.view(torch.uint8)).sum())
        differ += int((got_t.view(torch.uint8) != ref_t.view(torch.uint8)).sum())
        differ += int(float(amax) != float(t.abs().amax().float()))
    out["fused: values unlike torch's cast"] = differ  # 0 expected; a timing row either way
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8 * 2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        print("needs a CUDA GPU with float8 tensor cores (sm89+)", file=sys.stderr)
        return 2
    rows = {name: measure(args.tokens, k, n, args.warmup, args.iters) for name, (k, n) in SHAPES.items()}
    variants = list(next(iter(rows.values())))
    rows["layer"] = {v: sum(r[v] for r in rows.values()) for v in variants}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, T = {args.tokens}: ms per forward + backward")
    print("| linear | " + " | ".join(variants) + " |")
    print("| --- |" + " --- |" * len(variants))
    for name, r in rows.items():
        print(f"| {name} | " + " | ".join(f"{r[v]:.3f}" for v in variants) + " |")
    layer = rows["layer"]
    print(f"per step ({args.layers} layers): torchao {layer['torchao'] * args.layers:.1f} ms, delayed "
          f"{layer['delayed'] * args.layers:.1f} ms (saves {(layer['torchao'] - layer['delayed']) * args.layers:.1f}), "
          f"fused {layer['fused'] * args.layers:.1f}, fused-delayed {layer['fused-delayed'] * args.layers:.1f} ms, "
          f"GEMMs alone {layer['gemms'] * args.layers:.1f} ms, bf16 {layer['bf16'] * args.layers:.1f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": args.tokens,
                       "ms": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

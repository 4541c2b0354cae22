"""Fused CUDA kernels vs PyTorch eager vs torch.compile, Llama-3-8B-like shapes in bf16.

    python bench/bench_kernels.py [--tokens 8192 --hidden 4096 --ffn 14336 --heads 32 --head-dim 128 --vocab 128256]

Builds the extension on first use (hf_megatron/kernels/build.py).  For each op and pass (forward
alone under no_grad; forward + backward through autograd) it prints the median time of CUDA-event
timed runs, the effective bandwidth (the bytes the op must move at least: every input read once,
every output written once, divided by the time), the ratio to eager, and the largest difference
from eager's result.  A device-to-device copy gives the practical bandwidth ceiling.
Exits 0 after printing the table; 1 when CUDA is present but the extension fails to build.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install needed

from hf_megatron import kernels  # noqa: E402
from hf_megatron.kernels import cross_entropy, reference  # noqa: E402


def time_ms(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def copy_bandwidth(nbytes: int, warmup: int, iters: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), warmup, iters)
    return 2 * nbytes / ms / 1e6  # read + write, GB/s


def make_cases(tokens, hidden, ffn, heads, head_dim, dtype, vocab=128256):
    """(name, inputs factory, which inputs get grads, fused fn, eager fn, bytes forward, bytes backward)."""
    e = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    def rms_inputs():
        return [rand(tokens, hidden), 1 + 0.1 * rand(hidden)]

    def swiglu_inputs():
        return [rand(tokens, 2 * ffn)]

    def rotary_inputs():  # q as [b=1, heads, s=tokens, d]
        pos = torch.arange(tokens, device="cuda").float()[None, :, None]
        inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim))
        emb = torch.cat((pos * inv_freq, pos * inv_freq), -1)
        return [rand(1, heads, tokens, head_dim), emb.cos().to(dtype), emb.sin().to(dtype)]

    targets = torch.randint(0, vocab, (tokens,), generator=gen, device="cuda")

    def logits_inputs():
        return [rand(tokens, vocab)]

    eps = 1e-5
    table = 2 * tokens * head_dim * e  # cos + sin
    return [
        ("rms_norm", rms_inputs, (True, True), lambda x, w: kernels.rms_norm(x, w, eps),
         lambda x, w: reference.rms_norm_reference(x, w, eps),
         2 * tokens * hidden * e + hidden * e,            # read x, w; write y
         3 * tokens * hidden * e + 2 * hidden * e),       # read dy, x, w; write dx, dw
        ("swiglu", swiglu_inputs, (True,), kernels.swiglu, reference.swiglu_reference,
         3 * tokens * ffn * e,                            # read gate, up; write y
         5 * tokens * ffn * e),                           # read dy, gate, up; write d_gate, d_up
        ("rotary", rotary_inputs, (True, False, False), kernels.apply_rotary, reference.apply_rotary_reference,
         2 * heads * tokens * head_dim * e + table,       # read x, cos, sin; write y
         2 * heads * tokens * head_dim * e + table),      # read dy, cos, sin; write dx
        ("cross_ent", logits_inputs, (True,), lambda z: cross_entropy.cross_entropy(z, targets, vocab, -100),
         lambda z: reference.cross_entropy_reference(z, targets, vocab, -100),
         tokens * vocab * e + 16 * tokens,                # read logits, targets; write loss, lse
         2 * tokens * vocab * e + 16 * tokens),           # read logits, dloss, lse, targets; write d logits
    ]


def forward_runner(fn, inputs, needs_grad):
    def run():
        with torch.no_grad():
            return fn(*inputs)
    return run


def training_runner(fn, inputs, needs_grad):
    leaves = [t.clone().requires_grad_(flag) for t, flag in zip(inputs, needs_grad)]
    wrt = [t for t in leaves if t.requires_grad]
    out = fn(*leaves)
    gen = torch.Generator(device=out.device).manual_seed(1)  # the same upstream grad for every impl
    probe = torch.randn(out.shape, generator=gen, device=out.device).to(out.dtype)

    def run():
        return torch.autograd.grad(fn(*leaves), wrt, probe)
    return run


def measure(impls, runner, inputs, needs_grad, warmup, iters):
    """{impl: (ms, max |result - eager result|)}; a failing torch.compile gives (None, error text)."""
    expected = _as_list(runner(impls["eager"], inputs, needs_grad)())
    results = {}
    for impl, fn in impls.items():
        try:
            run = runner(fn, inputs, needs_grad)
            got = _as_list(run())
            ms = time_ms(run, warmup, iters)
        except Exception as err:  # torch.compile may be unusable here (no triton, ...)
            if impl != "compile":
                raise
            results[impl] = (None, f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:120]}")
            continue
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, expected))
        results[impl] = (ms, diff)
    return results


def _as_list(value):
    return list(value) if isinstance(value, (tuple, list)) else [value]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=14336)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=128256, help="cross entropy over [tokens, vocab] logits")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device; nothing to measure (the CPU path is the PyTorch fallback)")
        return 0
    if kernels.load_extension() is None or not kernels.enabled():
        print("bench_kernels: the CUDA extension is unavailable (see the warning above, or HF_MEGATRON_KERNELS=0)")
        return 1

    dtype = getattr(torch, args.dtype)
    ceiling = copy_bandwidth(1 << 30, args.warmup, args.iters)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | {args.dtype} | tokens {args.tokens} "
          f"hidden {args.hidden} ffn {args.ffn} heads {args.heads} head_dim {args.head_dim}")
    print(f"device-to-device copy: {ceiling:.0f} GB/s (read + write)\n")
    header = f"{'op':<10} {'pass':<8} {'impl':<8} {'ms':>8} {'GB/s':>7} {'%copy':>6} {'vs eager':>8} {'max|diff|':>10}"
    print(header)
    print("-" * len(header))

    compile_error = None
    for name, make_inputs, needs_grad, fused, eager, fwd_bytes, bwd_bytes in make_cases(
            args.tokens, args.hidden, args.ffn, args.heads, args.head_dim, dtype, args.vocab):
        inputs = make_inputs()
        impls = {"fused": fused, "eager": eager}
        if not args.no_compile and compile_error is None:
            impls["compile"] = torch.compile(eager, dynamic=False)
        for pass_name, runner, nbytes in (("fwd", forward_runner, fwd_bytes),
                                          ("fwd+bwd", training_runner, fwd_bytes + bwd_bytes)):
            results = measure(impls, runner, inputs, needs_grad, args.warmup, args.iters)
            eager_ms = results["eager"][0]
            for impl, (ms, diff) in results.items():
                if ms is None:
                    compile_error = diff
                    continue
                gbps = nbytes / ms / 1e6
                print(f"{name:<10} {pass_name:<8} {impl:<8} {ms:8.3f} {gbps:7.0f} {100 * gbps / ceiling:5.0f}% "
                      f"{eager_ms / ms:7.2f}x {diff:10.2e}")
        del inputs
        torch.cuda.empty_cache()
    if compile_error:
        print(f"\ntorch.compile column skipped: {compile_error}")
    print("\nGB/s: minimum bytes moved / time; vs eager: eager time / this time (higher is faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where one train step's GPU time goes: torch.profiler over a few steps of bench/throughput.py's
variants, side by side, kernels grouped by kind.

    python bench/profile_step.py --model gpt2-medium --variants hf-compile ours-compile
    python bench/profile_step.py --device cpu --tiny --model llama-1b        # dry run

Prints per variant: wall ms/step, summed GPU kernel ms/step (the gap is host-side idle time), and
the kernel time per group (matmul, attention, elementwise/fused, copies, reductions, optimizer,
memset, communication) and the top kernels by total time.  `--syncs` lists the CUDA runtime calls that
make the host wait (stream / device / event synchronise, blocking copies, frees, pinned allocations)
per step, with the ops and our Python frames around them: where a host falls behind its GPU.
Each variant is profiled in a fresh child process (`--no-isolate`: all in this one), as
bench/throughput.py measures them.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput  # noqa: E402

GROUPS = [  # first match wins; the patterns are kernel-name fragments
    ("attention", r"flash|fmha|cudnn|sdpa|attention"),
    ("matmul", r"gemm|cutlass|sm90_xmma|nvjet|matmul|wgmma"),
    ("optimizer", r"adam|multi_tensor"),
    ("memset/fill", r"fill|memset|zero"),
    ("copy/cast", r"copy|memcpy|cast|convert"),
    ("reduction", r"reduce|sum|norm_kernel|max"),
    ("compiled (triton)", r"triton"),
    ("communication", r"nccl|allreduce|allgather"),
]


def group_of(name: str) -> str:
    lowered = name.lower()
    for group, pattern in GROUPS:
        if re.search(pattern, lowered):
            return group
    return "other elementwise"


def idle_gaps(prof, count: int) -> list[tuple[float, str, str, str]]:
    """The `count` longest intervals with no kernel running (over the whole profile, so roughly
    `steps` times the per-step gaps): (ms, kernel before, kernel after, CPU ops overlapping)."""
    kernels = sorted((e for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
                      and e.time_range.end > e.time_range.start), key=lambda e: e.time_range.start)
    cpu_ops = [e for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CPU]
    found, busy_until, last = [], None, None
    for k in kernels:
        if busy_until is not None and k.time_range.start > busy_until:
            found.append((k.time_range.start - busy_until, busy_until, k.time_range.start, last.name, k.name))
        if busy_until is None or k.time_range.end > busy_until:
            busy_until, last = k.time_range.end, k
    rows = []
    for length, lo, hi, before, after in sorted(found, key=lambda g: -g[0])[:count]:
        overlapping = defaultdict(float)
        for op in cpu_ops:
            shared = min(op.time_range.end, hi) - max(op.time_range.start, lo)
            if shared > 0:
                overlapping[op.name] += shared
        names = ", ".join(n for n, _ in sorted(overlapping.items(), key=lambda kv: -kv[1])[:4])
        rows.append((length / 1e3, before[:50], after[:50], names[:160]))
    return rows


BLOCKING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaFree",
            "cudaHostAlloc", "cudaFreeHost", "cudaMalloc", "cudaStreamWaitEvent")


def blocking_calls(prof, steps: int) -> list[tuple[float, float, str, str, str]]:
    """(calls per step, ms per step, runtime call, enclosing ops innermost first, our frames) for
    the CUDA runtime calls in BLOCKING, most time first."""
    totals = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.name not in BLOCKING:
            continue
        chain, frames, parent = [], [], event.cpu_parent
        while parent is not None:
            if len(chain) < 4:
                chain.append(parent.name)
            if not frames:
                frames = [f for f in (parent.stack or []) if "hf_megatron" in f or "bench" in f][:3]
            parent = parent.cpu_parent
        key = (event.name, " < ".join(chain), " | ".join(frames))
        totals[key][0] += 1
        totals[key][1] += (event.time_range.end - event.time_range.start) / 1e3
    return sorted(((n / steps, ms / steps, *key) for key, (n, ms) in totals.items()), key=lambda r: -r[1])


def profile_variant(name: str, variant: str, args) -> dict:
    spec = (throughput.TINY if args.tiny else throughput.MODELS)[name]
    ids = torch.randint(0, throughput.hf_config(spec).vocab_size, (spec.batch, spec.seq), device=args.device,
                        generator=torch.Generator(args.device).manual_seed(1))
    step, cleanup = throughput.make_step(spec, variant, args.device, None, ids, args.lr)
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    try:
        for _ in range(args.warmup):
            step()
        sync()
        with torch.profiler.profile(activities=activities, with_stack=args.syncs) as prof:
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            sync()
            wall = (time.perf_counter() - start) / args.steps
    finally:
        if cleanup is not None:
            cleanup()
    per_group, per_kernel = defaultdict(float), defaultdict(float)
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", 0.0) if cuda else event.self_cpu_time_total
        if cuda and getattr(event, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        if not device_us:
            continue
        per_group[group_of(event.key)] += device_us / 1e3 / args.steps
        per_kernel[event.key] += device_us / 1e3 / args.steps
    gaps = idle_gaps(prof, args.gaps) if cuda and args.gaps else []
    syncs = blocking_calls(prof, args.steps) if args.syncs else []
    return {"model": name, "variant": variant, "wall_ms": wall * 1e3, "kernel_ms": sum(per_group.values()), "gaps": gaps,
            "syncs": syncs,
            "groups": dict(per_group), "top": sorted(per_kernel.items(), key=lambda kv: -kv[1])[: args.top],
            "by_group": {g: sorted(((k, ms) for k, ms in per_kernel.items() if group_of(k) == g),
                                   key=lambda kv: -kv[1])[: args.top] for g in args.breakdown}}


def profile_in_child(variant: str, args) -> dict:
    """One variant profiled in a fresh process, as bench/throughput.py measures: a variant built after
    another in one process finds its state (compiled graphs, a loaded csrc extension, allocator pools)
    and may run other code than it would alone (session 12: a deferred float8 step profiled second ran
    at float8's speed, while alone it was 12% slower).  The child's stderr passes through."""
    command = [sys.executable, __file__, "--model", args.model, "--variants", variant, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--top", str(args.top), "--lr", str(args.lr), "--device", args.device,
               "--gaps", str(args.gaps), "--child", "--no-isolate"]
    command += (["--tiny"] if args.tiny else []) + (["--syncs"] if args.syncs else [])
    command += ["--breakdown", *args.breakdown] if args.breakdown else []
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    found = [line[len("RESULT "):] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not found:
        raise SystemExit(f"profile_step.py: the child profiling {variant} exited {done.returncode} without a result "
                         "(its error is above)")
    return json.loads(found[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(throughput.MODELS), default="gpt2-medium")
    parser.add_argument("--variants", nargs="+", type=throughput.variant_name, default=["hf-compile", "ours-compile"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--gaps", type=int, default=0, metavar="N",
                        help="also list the N longest GPU idle gaps of the last profiled step, with the kernels "
                             "around them and the CPU ops that ran during them")
    parser.add_argument("--syncs", action="store_true",
                        help="also list the CUDA runtime calls that block the host, per step, with their callers "
                             "(records Python stacks: the wall time then includes that overhead)")
    parser.add_argument("--breakdown", nargs="*", default=[], metavar="GROUP",
                        help="also list the top kernels inside these groups (e.g. copy/cast reduction)")
    parser.add_argument("--no-isolate", dest="isolate", action="store_false",
                        help="profile every variant in this process (default: each in a fresh child process)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:  # one variant's result for the parent (profile_in_child)
        print("RESULT " + json.dumps(profile_variant(args.model, args.variants[0], args)), flush=True)
        return
    results = []
    for variant in args.variants:
        if args.isolate:
            results.append(profile_in_child(variant, args))
        else:
            throughput.free_memory(args.device)
            results.append(profile_variant(args.model, variant, args))
    groups = sorted({g for r in results for g in r["groups"]})
    print(f"\n{args.model}: ms per step")
    print("| | " + " | ".join(r["variant"] for r in results) + " |")
    print("| --- |" + " --- |" * len(results))
    print("| wall | " + " | ".join(f"{r['wall_ms']:.1f}" for r in results) + " |")
    print("| GPU kernels | " + " | ".join(f"{r['kernel_ms']:.1f}" for r in results) + " |")
    for group in groups:
        print(f"| {group} | " + " | ".join(f"{r['groups'].get(group, 0.0):.1f}" for r in results) + " |")
    for r in results:
        print(f"\n{r['variant']} top kernels (ms/step):")
        for key, ms in r["top"]:
            print(f"  {ms:7.2f}  {key[:110]}")
        if r["gaps"]:
            print(f"\n{r['variant']} longest GPU idle gaps (ms | kernel before | kernel after | CPU ops meanwhile):")
            for ms, before, after, ops in r["gaps"]:
                print(f"  {ms:6.2f} | {before} | {after} | {ops}")
        if args.syncs:
            print(f"\n{r['variant']} host-blocking CUDA calls (per step: calls | ms | call | ops around it | our frames):")
            for calls, ms, call, ops, frames in r["syncs"]:
                print(f"  {calls:5.1f} | {ms:6.2f} | {call} | {ops[:120]} | {frames[:200]}")
            if not r["syncs"]:
                print("  none recorded")
        for group, kernels in r["by_group"].items():
            print(f"\n{r['variant']} top kernels in {group} (ms/step):")
            for key, ms in kernels:
                print(f"  {ms:7.2f}  {key[:110]}")


if __name__ == "__main__":
    main()

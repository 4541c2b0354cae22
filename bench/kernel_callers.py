"""Which CPU ops (with input shapes, dtypes and our Python frames) launch the kernels whose names
contain a given fragment, over one profiled train step of a bench/throughput.py variant.

    python bench/kernel_callers.py --model gpt2-xl --variant ours-compile --kernel "reduce_kernel<128, 4"
    python bench/kernel_callers.py --device cpu --tiny --model gpt2-xl --variant ours --kernel sum   # dry run

Prints, per (op, shapes, dtypes, frames), the kernel ms per step and the number of launches: where a
kernel group of bench/profile_step.py's table comes from.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput  # noqa: E402


def our_frames(event) -> str:
    frames = [f for f in (event.stack or []) if "hf_megatron" in f or "bench/" in f]
    return " < ".join(f.split("hf_megatron/")[-1] for f in frames[:4])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(throughput.MODELS), default="gpt2-xl")
    parser.add_argument("--variant", type=throughput.variant_name, default="ours-compile")
    parser.add_argument("--kernel", required=True, help="a fragment of the kernel names to attribute")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    spec = throughput.spec_of(args.model, args.tiny)
    ids = torch.randint(0, throughput.hf_config(spec).vocab_size, (spec.batch, spec.seq), device=args.device,
                        generator=torch.Generator(args.device).manual_seed(1))
    step, cleanup = throughput.make_step(spec, args.variant, args.device, None, ids, 3e-4)
    flush = getattr(step, "flush", None)
    for _ in range(args.warmup):
        step()
    if flush is not None:
        flush()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    with profile(activities=activities, record_shapes=True, with_stack=True) as prof:
        step()
        if flush is not None:
            flush()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
    if cleanup is not None:
        cleanup()
    totals: dict[tuple, list] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CPU:
            continue
        # the innermost op that launched the kernel (its children launched none of these themselves)
        kernels = [k for k in event.kernels if args.kernel in k.name]
        if not kernels or any(args.kernel in k.name for c in event.cpu_children for k in c.kernels):
            continue
        if args.device == "cpu":
            kernels = []
        key = (event.name, str(event.input_shapes)[:120], str(getattr(event, "input_dtypes", ""))[:80],
               our_frames(event))
        totals[key][0] += sum(k.duration for k in kernels) / 1e3
        totals[key][1] += len(kernels)
    if args.device == "cpu":  # no kernels: attribute the ops whose name matches instead (dry run)
        for event in prof.events():
            if event.name.startswith("aten::") and args.kernel in event.name:
                key = (event.name, str(event.input_shapes)[:120], "", our_frames(event))
                totals[key][0] += event.self_cpu_time_total / 1e3
                totals[key][1] += 1
    print(f"{args.model} {args.variant}: ops launching '{args.kernel}' (ms per step | launches | op | shapes | frames)")
    for (name, shapes, dtypes, frames), (ms, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"  {ms:7.2f} | {n:4d} | {name} | {shapes} {dtypes} | {frames}")


if __name__ == "__main__":
    main()

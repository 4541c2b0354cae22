"""Bytes each rank moves over the data-parallel group per optimizer step, before and after the
grad-buffer / distributed-optimizer change (issue 15), computed -- not measured -- for a model
built on the meta device (default GPT-2 XL, dp = 2, bf16 params with fp32 main grads).

    python bench/dp_bytes.py [--model gpt2-xl] [--dp 2] [--fp32] [--busbw 360]

Ring collectives over dp ranks, per rank, for N elements of b bytes (sent = received):
    all-reduce       2 (dp-1)/dp x N b
    reduce-scatter     (dp-1)/dp x N b
    all-gather         (dp-1)/dp x N b
    broadcast from each param's owner: a rank receives the (dp-1)/dp of the params it does not own

    P = params of this rank, N = P + padding of the grad buffer (param starts to 64 elements,
    buckets to 64 x dp), g = 4 (fp32 main grads), w = param bytes (2 for bf16)

    before, plain:                 all-reduce of fp32 grads                2 (dp-1)/dp x 4 P
    before, --use-distributed-optimizer (ZeRO-1, whole params dealt to ranks):
                                   all-reduce + broadcast of every param   2 (dp-1)/dp x 4 P + (dp-1)/dp x w P
    after, plain (+ --overlap-grad-reduce): all-reduce per bucket          2 (dp-1)/dp x 4 N
    after, --use-distributed-optimizer: reduce-scatter + all-gather        (dp-1)/dp x (4 + w) N

Collective counts per step: before, grads were packed into 32 MiB flat copies (one all-reduce
each) and ZeRO-1 added one broadcast per owning rank; after, one collective per bucket
(--ddp-bucket-size elements, default max(40M, 1M x dp)) and per direction.  The times use an
assumed bus bandwidth (`--busbw`, GB/s) and are only a scale for the 2-GPU issue.
"""
from __future__ import annotations

import argparse
import math

import torch

MODELS = {"gpt2-xl": dict(n_embd=1600, n_layer=48, n_head=25), "gpt2-medium": dict(n_embd=1024, n_layer=24, n_head=16)}
OLD_BUCKET_BYTES = 32 * 1024 * 1024


def meta_params(name: str, dtype: torch.dtype):
    from transformers import GPT2Config

    from hf_megatron.config import ModelConfig
    from hf_megatron.model.gpt import GPTModel
    model = GPTModel(ModelConfig.from_hf(GPT2Config(n_positions=1024, **MODELS[name])), dtype=dtype, device="meta")
    seen, params = set(), []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    return model, params


def rows(model, params, dp: int, w: int, bucket_size: int | None):
    """([(what, bytes per rank per step, collectives per step)], P, N)."""
    from hf_megatron.parallel.grad_buffer import default_bucket_size, plan_buckets
    P = sum(p.numel() for p in params)
    plans = plan_buckets([model], params, dp, bucket_size or default_bucket_size(dp))
    N, buckets = sum(numel for *_, numel in plans), len(plans)
    share = (dp - 1) / dp
    old_packs = math.ceil(4 * P / OLD_BUCKET_BYTES)
    return [("before: plain all-reduce (32 MiB packs)", 2 * share * 4 * P, old_packs),
            ("before: ZeRO-1 all-reduce + per-owner broadcast", 2 * share * 4 * P + share * w * P, old_packs + dp),
            ("after: grad buffer all-reduce per bucket", 2 * share * 4 * N, buckets),
            ("after: distributed optimizer reduce-scatter + all-gather", share * (4 + w) * N, 2 * buckets)], P, N


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-xl", choices=sorted(MODELS))
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--fp32", action="store_true", help="fp32 params (default: bf16 params)")
    parser.add_argument("--ddp-bucket-size", type=int, default=None)
    parser.add_argument("--busbw", type=float, default=360.0, help="assumed bus bandwidth, GB/s (for the ms column)")
    args = parser.parse_args(argv)
    w = 4 if args.fp32 else 2
    model, params = meta_params(args.model, torch.float32 if args.fp32 else torch.bfloat16)
    table, P, N = rows(model, params, args.dp, w, args.ddp_bucket_size)
    print(f"{args.model}: P = {P:,} params, grad buffer N = {N:,} elements (padding {N - P:,}), dp = {args.dp}, "
          f"{'fp32' if args.fp32 else 'bf16'} params, fp32 main grads")
    print(f"{'':58s} {'GB/rank/step':>12s} {'x P bytes':>9s} {'collectives':>11s} {'ms @ ' + str(args.busbw):>10s}")
    for what, nbytes, count in table:
        print(f"{what:58s} {nbytes / 1e9:12.3f} {nbytes / P:9.2f} {count:11d} {nbytes / (args.busbw * 1e9) * 1e3:10.2f}")
    old_zero, new_zero = table[1][1], table[3][1]
    print(f"distributed optimizer: {old_zero / new_zero:.2f}x fewer bytes than the former ZeRO-1")


if __name__ == "__main__":
    main()

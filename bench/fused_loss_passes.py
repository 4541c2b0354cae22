"""The fused loss's per-chunk passes (parallel/linear_loss.py), side by side in one run:

    eager passes, eager      linear_loss.EAGER as the uncompiled model runs them (fp32 copy, in place)
    eager passes, compiled   EAGER under torch.compile (what `--torch-compile` ran before session 6)
    pure passes, compiled    linear_loss.COMPILED under torch.compile (what it runs now)

    python bench/fused_loss_passes.py                         # CPU, a [256, 32000] chunk
    python bench/fused_loss_passes.py --device cuda --rows 1046 --vocab 128256   # the Llama 1.2B's chunk

One chunk of bf16 logits with ~4% ignored targets: stats (row max, target logit), probs (sum of
exp), grad (loss and the bf16 P = softmax - onehot); median of `--repeats` timed calls after two
warm-up calls, and each variant's largest difference from the uncompiled one (loss, P).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from hf_megatron.parallel import linear_loss
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    gen = torch.Generator(device=args.device).manual_seed(0)
    logits = (torch.randn(args.rows, args.vocab, generator=gen, device=args.device) * 3).to(torch.bfloat16)
    targets = torch.randint(0, args.vocab, (args.rows,), generator=gen, device=args.device)
    targets[: max(1, args.rows // 25)] = -100
    ignored = targets == -100
    inside, local = ~ignored, targets.masked_fill(ignored, 0)

    def run(fns):
        stats, probs, grad = fns
        z, row_max, picked = stats(logits.clone(), local, inside, args.vocab)  # clone: the GEMM's fresh output
        e, sum_exp = probs(z, row_max, args.vocab)
        return grad(e, sum_exp, row_max, picked, local, inside, ignored, torch.bfloat16, args.vocab)

    variants = {"eager passes, eager": linear_loss.EAGER,
                "eager passes, compiled": tuple(torch.compile(f) for f in linear_loss.EAGER),
                "pure passes, compiled": tuple(torch.compile(f) for f in linear_loss.COMPILED)}
    rows, reference = [], None
    for name, fns in variants.items():
        out = run(fns)
        run(fns)
        times = []
        for _ in range(args.repeats):
            sync()
            start = time.perf_counter()
            run(fns)
            sync()
            times.append(time.perf_counter() - start)
        reference = reference or out
        rows.append((name, statistics.median(times) * 1e3, abs(out[0] - reference[0]).item(),
                     (out[1].float() - reference[1].float()).abs().max().item()))
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu (1 thread)"
    print(f"{name}, torch {torch.__version__}, chunk [{args.rows}, {args.vocab}] bf16")
    print("| passes | ms per chunk | loss diff | max P diff |\n| --- | --- | --- | --- |")
    for name, ms, dl, dp in rows:
        print(f"| {name} | {ms:.2f} | {dl:.1e} | {dp:.1e} |")


if __name__ == "__main__":
    main()

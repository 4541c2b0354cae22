"""Host (CPU) time of hf_megatron's train_step on a model whose kernels cost next to nothing.

    python bench/host_overhead.py                # GPT-2 shape, 24 layers (GPT-2 medium's module and
                                                 # parameter count), hidden 64, batch 2 x seq 32, bf16, CPU

On a GPU the step of a small model is host-bound (bench/RESULTS.md, session 4-5 profiles: the GPU
waits for Python between kernels), so the host time per step is what such a step costs.  Here the
same train_step runs on the CPU with tensors so small that the CPU kernels are a minor part, in two
configurations, interleaved `--rounds` times (the median is printed, process CPU time, one thread):

    before   the step as of session 5: the fp32 grad buffer allocated up front and folded into,
             torch's `optimizer.step()` (every `.grad` set and cleared), `Module.train()` every step
    after    today's defaults: the lazy grad buffer, torch's fused AdamW kernel called directly,
             `Module.train()` only when a chunk is not in train mode

Both use torch's fused CPU AdamW (the CUDA default is fused too).  The numbers are this CPU's, not
the GPU host's; the ratio is what carries over.

    python bench/host_overhead.py --scopes       # the same step eager, compiled per layer, and
                                                 # compiled as one decoder region (--torch-compile-scope)
                                                 # on a 24-layer hidden-16 GPT-2 (inductor, CPU)

The compiled rows include what inductor's CPU kernels gain by fusing, so they are an upper bound on
the host time the decoder region saves, not a GPU prediction.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput  # noqa: E402


def build(before: bool, compile=False, hidden: int = 64):
    from hf_megatron.parallel import state
    from hf_megatron.training import TrainingConfig, build_model, build_optimizer, setup_parallel
    spec = throughput.Spec("gpt2", 2, 32, dict(n_embd=hidden, n_layer=24, n_head=4, vocab_size=300,
                                                bos_token_id=0, eos_token_id=0))
    cfg = TrainingConfig(micro_batch_size=2, global_batch_size=2, lr=1e-4, bf16=True, clip_grad=1.0)
    state.reset()
    setup_parallel(cfg)
    chunks = build_model(throughput.hf_model(spec, "cpu"), cfg, device="cpu", compile=compile)
    opt = throughput.session5_optimizer(chunks, cfg) if before else build_optimizer(chunks, cfg)
    groups = [{k: v for k, v in g.items() if k not in ("fused", "foreach")} for g in opt.optimizer.param_groups]
    opt.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, fused=True)  # as on CUDA (make_adam)
    return chunks, opt


def timed(before: bool, steps: int, compile=False, hidden: int = 64) -> float:
    from hf_megatron.model.gpt import shift_labels
    from hf_megatron.training import fused_adamw
    from hf_megatron.training.trainer import train_step
    chunks, opt = build(before, compile, hidden)
    ids = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = [{"input_ids": ids, "targets": shift_labels(ids)}]
    direct = fused_adamw.torch_step_
    if before:
        fused_adamw.torch_step_ = lambda *args: False
    try:
        for _ in range(3):
            train_step(chunks, opt, None, batch)
        start = time.process_time()
        for _ in range(steps):
            if before:
                for chunk in chunks:
                    chunk.train()
            train_step(chunks, opt, None, batch)
        return (time.process_time() - start) / steps
    finally:
        fused_adamw.torch_step_ = direct


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--scopes", action="store_true", help="eager vs per-layer vs decoder-region compile")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.scopes:
        variants = {"eager": False, "compiled per layer": {"scope": "layer"}, "one decoder region": {"scope": "decoder"}}
        times = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, compile in variants.items():
                times[name].append(timed(False, args.steps, compile, hidden=16))
        print(f"torch {torch.__version__}, {args.rounds} rounds x {args.steps} steps, median process CPU ms per step")
        print("| 24-layer hidden-16 GPT-2 | ms per step |\n| --- | --- |")
        for name, values in times.items():
            print(f"| {name} | {statistics.median(values) * 1e3:.2f} |")
        return
    times = {"before": [], "after": []}
    for _ in range(args.rounds):
        for name in times:
            times[name].append(timed(name == "before", args.steps))
    before, after = (statistics.median(times[k]) * 1e3 for k in ("before", "after"))
    print(f"torch {torch.__version__}, {args.rounds} rounds x {args.steps} steps, median process CPU ms per step")
    print("| configuration | ms per step |\n| --- | --- |")
    print(f"| before (session 5's step) | {before:.2f} |\n| after | {after:.2f} |")
    print(f"after / before: {after / before:.3f}")


if __name__ == "__main__":
    main()

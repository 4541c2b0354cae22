"""Parity under NCCL in bf16: a few training steps in one parallel layout, losses written to JSON.

    torchrun --nproc-per-node 1 bench/gpu_parity.py --out ref.json                 # single GPU
    torchrun --nproc-per-node 2 bench/gpu_parity.py --tp 2 --sp --dist-opt --out tp2.json
    python bench/gpu_parity.py --compare ref.json tp2.json ...                      # table + verdict

Every layout starts from the same weights (each full tensor drawn from its own (seed, name) generator)
and reads the same global batches.  bf16 tolerance: the per-step loss may differ from the
single-GPU run by 1% relative -- bf16 has an 8-bit mantissa (relative rounding 2^-9 ~ 0.2%),
and TP/PP/DP change the order of reductions, so per-step differences of a few 0.1% are rounding,
while a wrong shard, a missing all-reduce or a mis-scaled gradient moves the loss by far more
within five steps at this learning rate.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
TOLERANCE = 0.01


def run(args) -> None:
    from hf_megatron.config import ModelConfig
    from hf_megatron.parallel import state
    from hf_megatron.training import trainer
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        dist.init_process_group("nccl")
    cfg = trainer.TrainingConfig(micro_batch_size=2, global_batch_size=8, train_iters=args.steps, lr=3e-4,
                                 lr_warmup_iters=0, bf16=True, tensor_model_parallel_size=args.tp,
                                 pipeline_model_parallel_size=args.pp, virtual_pipeline_model_parallel_size=args.vpp,
                                 sequence_parallel=args.sp, use_distributed_optimizer=args.dist_opt, seed=7,
                                 **{name: True for name in ("overlap_grad_reduce", "overlap_param_gather")
                                    if getattr(args, name)})
    trainer.setup_parallel(cfg)
    grid = state.get_state()
    model_cfg = ModelConfig(model_type="llama", vocab_size=1000, hidden_size=512, num_layers=4,
                            num_attention_heads=8, num_query_groups=4, ffn_hidden_size=1376,
                            max_position_embeddings=256)
    chunks = trainer.build_model(model_cfg, cfg, device=torch.device("cuda", local))
    optimizer = trainer.build_optimizer(chunks, cfg)
    scheduler = trainer.build_scheduler(optimizer, cfg)
    data = torch.randint(0, 1000, (args.steps, 8, 129), generator=torch.Generator().manual_seed(0))
    losses = []
    for step in range(args.steps):
        stats = trainer.train_step(chunks, optimizer, scheduler, trainer.split_batch({
            "input_ids": data[step, :, :-1].cuda(), "targets": data[step, :, 1:].cuda()}, cfg))
        losses.append(stats["loss"])
    if not dist.is_initialized() or dist.get_rank() == 0:
        layout = f"tp{args.tp} pp{args.pp} dp{grid.dp}" + (f" vpp{args.vpp}" if args.vpp else "")
        Path(args.out).write_text(json.dumps({"layout": layout + (" sp" if args.sp else "") +
                                              (" distopt" if args.dist_opt else "") +
                                              (" overlap" if args.overlap_grad_reduce else ""), "losses": losses}))
    if dist.is_initialized():
        dist.destroy_process_group()


def compare(paths: list[str]) -> int:
    results = [json.loads(Path(p).read_text()) for p in paths if Path(p).is_file()]
    missing = [p for p in paths if not Path(p).is_file()]
    ref = results[0]
    worst_all = 0.0
    print(f"{'layout':28s} {'max rel diff vs 1 GPU':>22s}  losses")
    for r in results:
        worst = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"]))
        worst_all = max(worst_all, worst)
        print(f"{r['layout']:28s} {worst:22.2e}  {' '.join(f'{x:.4f}' for x in r['losses'])}")
    for p in missing:
        print(f"{p}: MISSING (that layout failed)")
    ok = not missing and worst_all <= TOLERANCE
    print(f"parity {'PASS' if ok else 'FAIL'} (tolerance {TOLERANCE:.0%} relative per step)")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--vpp", type=int, default=None)
    parser.add_argument("--sp", action="store_true")
    parser.add_argument("--dist-opt", action="store_true")
    parser.add_argument("--overlap-grad-reduce", action="store_true")
    parser.add_argument("--overlap-param-gather", action="store_true")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out")
    parser.add_argument("--compare", nargs="+")
    args = parser.parse_args()
    if args.compare:
        return compare(args.compare)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

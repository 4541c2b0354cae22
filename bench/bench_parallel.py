"""Training throughput of one parallel layout (run under torchrun; one process per GPU).

    torchrun --nproc-per-node 2 bench/bench_parallel.py --model 3b --tp 2 --sp --dist-opt --out r.json
    python bench/bench_parallel.py --model 3b --hf-anchor --out anchor.json   # transformers, 1 GPU
    torchrun --nproc-per-node 2 bench/bench_parallel.py --model gpt2-xl --overlap-grad-reduce --compile --out r.json
    torchrun --nproc-per-node 2 bench/bench_parallel.py --model gpt2-xl --hf-ddp --compile --out ddp.json

Models: the Llama-style shapes below, and bench/throughput.py's single-GPU models (gpt2-medium,
gpt2-xl, llama-1b: built from their transformers configs, FLOPs counted as there).  `--hf-ddp`:
transformers (fp32 weights, bf16 autocast, SDPA, fused AdamW, optionally compiled) under torch DDP,
micro batches accumulated under `no_sync` -- the multi-GPU anchor.

Model FLOPs per token (forward + backward = 3 x forward), causal attention counted once:
    6 * (matmul params, embedding lookups excluded, output layer included) + 6 * L * s * h
MFU = achieved model FLOP/s per GPU / the bf16 matmul peak measured on this GPU in the same run
(`--peak`, from bench/matmul_peak.py); the datasheet dense peak (989 TFLOP/s) is reported beside it.
Weights are random (normal(0, 0.02), drawn on the GPU): speed does not depend on their values.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput  # noqa: E402  (the single-GPU issue's model specs)

MODELS = {
    # issue 7: Llama-style ~3B
    "3b": dict(hidden_size=3072, num_layers=28, num_attention_heads=24, num_query_groups=8, ffn_hidden_size=8192,
               vocab_size=128256),
    # issue 8: Llama-3-8B shape
    "8b": dict(hidden_size=4096, num_layers=32, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=14336,
               vocab_size=128256),
    "1b": dict(hidden_size=2048, num_layers=16, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=8192,
               vocab_size=128256),
    "tiny": dict(hidden_size=256, num_layers=4, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=512,
                 vocab_size=1024),
}
DATASHEET_PEAK = 989e12


def model_config(name: str, seq: int):
    from hf_megatron.config import ModelConfig
    if name in throughput.MODELS:
        return ModelConfig.from_hf(throughput.hf_config(throughput.Spec(**{**throughput.MODELS[name].__dict__,
                                                                            "seq": seq})))
    return ModelConfig(model_type="llama", max_position_embeddings=seq, rotary_base=500000.0,
                       norm_epsilon=1e-5, **MODELS[name])


def flops_per_token(cfg, seq: int, name: str | None = None) -> float:
    if name in throughput.MODELS:
        return throughput.flops_per_token(throughput.Spec(**{**throughput.MODELS[name].__dict__, "seq": seq}))
    h, L, f = cfg.hidden_size, cfg.num_layers, cfg.ffn_hidden_size
    qkv = h * (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.kv_channels
    proj = cfg.num_attention_heads * cfg.kv_channels * h
    mlp = h * f * 3
    matmul_params = L * (qkv + proj + mlp) + h * cfg.vocab_size
    return 6 * matmul_params + 6 * L * seq * h


def fast_random_init(chunks) -> None:
    with torch.no_grad():
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                if "layernorm" in name:
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02)


def run_megatron(args) -> dict:
    from hf_megatron.parallel import state
    from hf_megatron.training import trainer
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        dist.init_process_group("nccl")
    cfg = trainer.TrainingConfig(
        micro_batch_size=args.mbs, global_batch_size=args.gbs, train_iters=args.steps + args.warmup, lr=1e-5,
        bf16=True, tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vpp, sequence_parallel=args.sp,
        use_distributed_optimizer=args.dist_opt, recompute_granularity=args.recompute, torch_compile=args.compile,
        **{name: True for name in ("overlap_grad_reduce", "overlap_param_gather") if getattr(args, name)})
    trainer.setup_parallel(cfg)
    grid = state.get_state()
    model_cfg = model_config(args.model, args.seq)
    # random values drawn on the GPU below (a CPU Megatron init of an 8B model takes minutes)
    chunks = trainer.build_model(model_cfg, cfg, device=torch.device("cuda", local), init=False)
    fast_random_init(chunks)
    optimizer = trainer.build_optimizer(chunks, cfg)
    num_micro = cfg.num_micro_batches(grid.dp)
    gen = torch.Generator(device="cuda").manual_seed(grid.coords["dp"])
    micro = [{"input_ids": ids, "targets": ids} for ids in
             (torch.randint(0, model_cfg.vocab_size, (args.mbs, args.seq), device="cuda", generator=gen)
              for _ in range(num_micro))]
    torch.cuda.reset_peak_memory_stats()
    for _ in range(args.warmup):
        trainer.train_step(chunks, optimizer, None, micro)
    torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        stats = trainer.train_step(chunks, optimizer, None, micro)
    torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / args.steps
    world = dist.get_world_size() if dist.is_initialized() else 1
    return summarize(args, model_cfg, elapsed, world, loss=stats["loss"],
                     layout=f"tp{args.tp} pp{args.pp} dp{grid.dp}" + (f" vpp{args.vpp}" if args.vpp else "")
                     + (" overlap" if args.overlap_grad_reduce else "") + (" compile" if args.compile else ""))


def run_hf_ddp(args) -> dict:
    """transformers under torch DDP (one process per GPU): the multi-GPU anchor."""
    from torch.nn.parallel import DistributedDataParallel
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("nccl")
    spec = throughput.Spec(**{**throughput.MODELS[args.model].__dict__, "seq": args.seq})
    model = throughput.hf_model(spec, "cuda")
    model.train()
    ddp = DistributedDataParallel(model, device_ids=[local]) if world > 1 else model
    if args.compile:
        ddp.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    num_micro = args.gbs // (args.mbs * world)
    gen = torch.Generator(device="cuda").manual_seed(dist.get_rank() if world > 1 else 0)
    ids = torch.randint(0, model.config.vocab_size, (num_micro, args.mbs, args.seq), device="cuda", generator=gen)

    step = hf_train_step(ddp, model, optimizer, ids, autocast=True, no_sync=ddp.no_sync if world > 1 else None)
    elapsed, loss = timed(step, args)
    return summarize(args, model_config(args.model, args.seq), elapsed, world, loss=loss.item() * num_micro,
                     layout=f"transformers DDP {world} GPU" + (" compile" if args.compile else ""))


def run_hf_anchor(args) -> dict:
    """transformers LlamaForCausalLM, bf16 weights, fused torch AdamW, SDPA: the 1-GPU anchor."""
    from transformers import LlamaConfig, LlamaForCausalLM
    m = MODELS[args.model]
    config = LlamaConfig(vocab_size=m["vocab_size"], hidden_size=m["hidden_size"],
                         intermediate_size=m["ffn_hidden_size"], num_hidden_layers=m["num_layers"],
                         num_attention_heads=m["num_attention_heads"], num_key_value_heads=m["num_query_groups"],
                         max_position_embeddings=args.seq, tie_word_embeddings=False)
    torch.cuda.set_device(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    num_micro = args.gbs // args.mbs
    ids = torch.randint(0, config.vocab_size, (num_micro, args.mbs, args.seq), device="cuda")

    elapsed, loss = timed(hf_train_step(model, model, optimizer, ids), args)
    return summarize(args, model_config(args.model, args.seq), elapsed, 1, loss=loss.item() * num_micro,
                     layout="transformers 1 GPU (bf16 weights + AdamW)")


def hf_train_step(call, model, optimizer, ids, autocast: bool = False, no_sync=None):
    """A transformers step over the micro batches ids[i]: mean loss, clip 1.0, AdamW.  `no_sync`
    (DDP) wraps every micro batch but the last, so the all-reduce runs once per step."""
    num_micro = ids.shape[0]

    def step():
        for i in range(num_micro):
            last = i == num_micro - 1 or no_sync is None
            with contextlib.nullcontext() if last else no_sync():
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                    loss = call(input_ids=ids[i], labels=ids[i]).loss / num_micro
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def timed(step, args):
    """(seconds per step over args.steps after args.warmup, last step's result); peak memory reset first."""
    torch.cuda.reset_peak_memory_stats()
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        result = step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / args.steps, result


def summarize(args, cfg, step_time: float, world: int, loss: float, layout: str) -> dict:
    tokens = args.gbs * args.seq
    flops = flops_per_token(cfg, args.seq, args.model) * tokens / step_time / world
    peak = args.peak or DATASHEET_PEAK
    return {"model": args.model, "layout": layout, "gpus": world, "seq": args.seq, "global_batch": args.gbs,
            "step_s": round(step_time, 4), "tokens_per_s": round(tokens / step_time, 1),
            "tokens_per_s_per_gpu": round(tokens / step_time / world, 1), "tflops_per_gpu": round(flops / 1e12, 1),
            "mfu_measured_peak": round(flops / peak, 4), "mfu_datasheet": round(flops / DATASHEET_PEAK, 4),
            "max_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1), "loss": round(float(loss), 4),
            "sp": args.sp, "dist_opt": args.dist_opt, "recompute": args.recompute,
            "fused_kernels": _kernels_in_use() and not layout.startswith("transformers")}


def _kernels_in_use() -> bool:
    from hf_megatron.kernels import kernels_available
    return bool(kernels_available())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(MODELS) + sorted(throughput.MODELS), default="3b")
    parser.add_argument("--seq", type=int, default=None, help="default: 4096, or the throughput.py model's")
    parser.add_argument("--mbs", type=int, default=1)
    parser.add_argument("--gbs", type=int, default=8)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--vpp", type=int, default=None)
    parser.add_argument("--sp", action="store_true")
    parser.add_argument("--dist-opt", action="store_true")
    parser.add_argument("--recompute", choices=["full", "selective"], default=None)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--peak", type=float, default=None, help="measured bf16 matmul FLOP/s")
    parser.add_argument("--hf-anchor", action="store_true")
    parser.add_argument("--hf-ddp", action="store_true", help="transformers + torch DDP (throughput.py models)")
    parser.add_argument("--compile", action="store_true", help="regional torch.compile (ours) / model.compile (hf)")
    parser.add_argument("--overlap-grad-reduce", action="store_true")
    parser.add_argument("--overlap-param-gather", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.seq is None:
        args.seq = throughput.MODELS[args.model].seq if args.model in throughput.MODELS else 4096
    result = run_hf_anchor(args) if args.hf_anchor else run_hf_ddp(args) if args.hf_ddp else run_megatron(args)
    if not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1:
        Path(args.out).write_text(json.dumps(result))
        print(json.dumps(result), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

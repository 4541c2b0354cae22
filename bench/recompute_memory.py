"""Peak activation memory of one training step with and without activation recompute (CPU).

    .venv/bin/python bench/recompute_memory.py [--hidden 256 --layers 4 --seq 1024 --batch 2]

Two measurements per mode (no CUDA needed):
* peak: torch's MemTracker (a dispatch-mode allocator tracker, any device) over forward +
  backward; the ACT column is the peak of activation memory, Total includes params/grads.
* saved: bytes autograd keeps for backward, summed over distinct storages seen by
  `saved_tensors_hooks` (under full recompute plus the checkpointed layer inputs).
Attention dropout > 0 makes torch use the math SDPA path (attention probabilities materialised,
which selective recompute drops); with dropout 0 on CPU the flash kernel keeps only O and the
log-sum-exp, so selective recompute has little left to save.
"""
from __future__ import annotations

import argparse

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from hf_megatron.config import ModelConfig
from hf_megatron.loading import build_model


def saved_bytes(model, ids) -> int:
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(ids, labels=ids, return_logits=False)
    out.loss.backward()
    return sum(n for ptr, n in storages.items() if ptr not in params)


def peak(model, ids) -> dict:
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        model(ids, labels=ids, return_logits=False).loss.backward()
    snap = tracker.get_tracker_snapshot("peak")
    per_device = next(iter(snap.values()))
    return {str(k).split(".")[-1]: v for k, v in per_device.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    mib = 2.0 ** 20
    print(f"llama-style, hidden {args.hidden}, {args.layers} layers, {args.heads} heads, seq {args.seq}, "
          f"batch {args.batch}, vocab {args.vocab} (fp32, CPU)")
    print(f"{'attn dropout':>12} {'recompute':>10} {'peak ACT MiB':>13} {'peak total MiB':>15} {'saved MiB':>10}")
    for dropout in (0.0, 0.1):
        config = ModelConfig(model_type="llama", vocab_size=args.vocab, hidden_size=args.hidden,
                             num_layers=args.layers, num_attention_heads=args.heads, ffn_hidden_size=3 * args.hidden,
                             attention_dropout=dropout)
        for mode in (None, "selective", "full"):
            model = build_model(config, recompute=mode, seed=0)
            model.train()
            saved = saved_bytes(model, ids)
            if mode == "full":
                saved += args.layers * args.seq * args.batch * args.hidden * 4  # checkpointed inputs
            model.zero_grad(set_to_none=True)
            p = peak(model, ids)
            print(f"{dropout:>12} {str(mode):>10} {p['ACT'] / mib:>13.1f} {p['Total'] / mib:>15.1f} {saved / mib:>10.1f}")


if __name__ == "__main__":
    main()

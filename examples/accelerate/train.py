"""Fine-tune a transformers causal LM with Megatron-style parallelism through accelerate.

    accelerate launch --config_file examples/accelerate/megatron_tp2.yaml examples/accelerate/train.py \
        --model gpt2 --text-file corpus.txt --steps 100

The only hf_megatron-specific line is the Accelerator import; the loop is accelerate's
Megatron-LM convention (the step runs inside `model(**batch)`).
"""
import argparse
import json

import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

from hf_megatron import Accelerator


def token_blocks(args) -> torch.Tensor:
    if args.text_file:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
        ids = tokenizer(open(args.text_file, encoding="utf-8").read(), return_tensors="pt").input_ids[0]
    else:  # random tokens: a smoke run without any data
        vocab = AutoModelForCausalLM.from_pretrained(args.model).config.vocab_size
        ids = torch.randint(0, vocab, (args.seq_len * args.batch_size * args.steps * 64,),
                            generator=torch.Generator().manual_seed(args.seed))
    usable = ids.numel() // args.seq_len * args.seq_len
    if usable == 0:
        raise SystemExit(f"--text-file {args.text_file}: fewer than --seq-len={args.seq_len} tokens")
    return ids[:usable].view(-1, args.seq_len)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="save_pretrained folder or Hub id")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--text-file", default=None)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=2,
                        help="micro batch size (accelerate's Megatron-LM meaning: each step takes "
                             "batch size x num_micro_batches samples per data-parallel rank)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--warmup", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-file", default=None, help="write the per-step losses as JSON (rank 0)")
    parser.add_argument("--save", default=None, help="Megatron-layout checkpoint folder at the end")
    parser.add_argument("--save-hf", default=None, help="Hugging Face folder at the end (from_pretrained loads it)")
    args = parser.parse_args()

    accelerator = Accelerator()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    blocks = token_blocks(args)
    loader = DataLoader(TensorDataset(blocks), batch_size=args.batch_size, shuffle=False, drop_last=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup, args.steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    losses = []
    model.train()
    for step, (input_ids,) in enumerate(loader):
        if step == args.steps:
            break
        loss = model(input_ids=input_ids).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        accelerator.print(f"step {step + 1:4d}  loss {loss.item():.4f}")
    if args.save:
        accelerator.save_state(args.save)  # Megatron-LM layout (+ transformers weights beside it)
    if args.save_hf:
        accelerator.save_model(model, args.save_hf)  # a folder AutoModelForCausalLM.from_pretrained loads
    if args.log_file and accelerator.is_main_process:
        with open(args.log_file, "w") as f:
            json.dump({"losses": losses}, f)


if __name__ == "__main__":
    main()

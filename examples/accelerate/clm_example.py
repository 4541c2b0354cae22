"""A plain accelerate training loop (in the style of accelerate's examples/nlp_example.py) for a
causal LM, run by hf_megatron under a Megatron-LM config:

    accelerate launch --config_file examples/accelerate/megatron_tp2.yaml examples/accelerate/clm_example.py \
        --model path/to/model --train_file train.txt --validation_file valid.txt --output_dir out

The only hf_megatron line is the Accelerator import.  It uses what accelerate's API offers:
prepare in several calls, gradient accumulation, the user's weight-decay parameter groups, a
transformers LR schedule, eval with logits and gather_for_metrics, unwrap_model(...).save_pretrained,
generate, save_model and save_state.  Without a Megatron config it runs as plain accelerate.
"""
import argparse
import json
import os
from pathlib import Path

import torch
from accelerate.utils import DistributedType, MegatronLMPlugin, set_seed
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator, get_linear_schedule_with_warmup

from hf_megatron import Accelerator


def blocks_of(tokenizer, path: str, block_size: int) -> list[dict]:
    ids = tokenizer(Path(path).read_text(encoding="utf-8"))["input_ids"]
    usable = len(ids) // block_size * block_size
    blocks = torch.tensor(ids[:usable]).view(-1, block_size)
    return [{"input_ids": b, "labels": b} for b in blocks]


def training_function(args):
    megatron = os.environ.get("ACCELERATE_USE_MEGATRON_LM", "false").lower() == "true"
    plugin = {"megatron_lm_plugin": MegatronLMPlugin(return_logits=True)} if megatron else {}
    accelerator = Accelerator(cpu=args.cpu, gradient_accumulation_steps=args.gradient_accumulation_steps, **plugin)
    set_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    with accelerator.main_process_first():
        train_blocks = blocks_of(tokenizer, args.train_file, args.block_size)
        eval_blocks = blocks_of(tokenizer, args.validation_file, args.block_size)
    train_dataloader = DataLoader(train_blocks, batch_size=args.batch_size, collate_fn=default_data_collator)
    eval_dataloader = DataLoader(eval_blocks, batch_size=args.eval_batch_size, collate_fn=default_data_collator)

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    no_decay = ("bias", "norm")
    groups = [{"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
               "weight_decay": args.weight_decay},
              {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)],
               "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)

    # as accelerate's examples (nlp_example.py): the schedule is sized from the loader before prepare;
    # accelerate steps it once per batch of that loader, i.e. num_processes times an update (under
    # Megatron-LM: data-parallel size x num_micro_batches), so it spans the run in any layout
    steps = len(train_dataloader) * args.num_epochs // args.gradient_accumulation_steps
    lr_scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup, steps)
    # prepared in several calls
    model, optimizer = accelerator.prepare(model, optimizer)
    train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(train_dataloader, eval_dataloader,
                                                                          lr_scheduler)
    updates = len(train_dataloader) * args.num_epochs // args.gradient_accumulation_steps
    accelerator.print(f"distributed type {accelerator.distributed_type}, {steps} schedule steps, ~{updates} updates")

    results = {"losses": [], "eval": []}
    for epoch in range(args.num_epochs):
        model.train()
        for batch in train_dataloader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            results["losses"].append(loss.item())

        model.eval()
        correct = total = samples = 0
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            correct += (predictions[:, :-1] == references[:, 1:]).sum().item()
            total += references[:, 1:].numel()
            samples += references.shape[0]
        results["eval"].append({"epoch": epoch, "accuracy": correct / total, "samples": samples})
        accelerator.print(f"epoch {epoch}: next-token accuracy {correct / total:.4f} over {samples} samples")

        # every epoch into the same folder: a later save overwrites the earlier one
        accelerator.wait_for_everyone()
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(Path(args.output_dir) / "hf", is_main_process=accelerator.is_main_process,
                                  save_function=accelerator.save)

    prompt = torch.tensor([eval_blocks[0]["input_ids"][:4].tolist()])
    results["generated"] = unwrapped.generate(prompt, max_new_tokens=6, do_sample=False).tolist()
    accelerator.save_model(model, Path(args.output_dir) / "save_model")
    state_dict = accelerator.get_state_dict(model)
    results["state_dict_names"] = sorted(state_dict)
    accelerator.save_state(Path(args.output_dir) / "state")
    if accelerator.is_main_process:
        tokenizer.save_pretrained(Path(args.output_dir) / "hf")
        with open(Path(args.output_dir) / "results.json", "w") as f:
            json.dump(results, f)
    accelerator.end_training()
    return accelerator.distributed_type == DistributedType.MEGATRON_LM


def main():
    parser = argparse.ArgumentParser(description="Plain accelerate loop for a causal LM.")
    parser.add_argument("--model", required=True)
    parser.add_argument("--train_file", required=True)
    parser.add_argument("--validation_file", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--block_size", type=int, default=16)
    parser.add_argument("--batch_size", type=int, default=2, help="micro batch size under Megatron-LM")
    parser.add_argument("--eval_batch_size", type=int, default=3)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight_decay", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=1, help="warmup in schedule steps (batches of the unprepared loader)")
    parser.add_argument("--num_epochs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--cpu", action="store_true", help="train on the CPU")
    training_function(parser.parse_args())


if __name__ == "__main__":
    main()

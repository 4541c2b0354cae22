"""A transformers LR schedule in an accelerate script, sized as accelerate's examples size it: from
the loader as the script built it, before `prepare` (tests/test_accelerate_user.py runs it under
`accelerate launch` with a Megatron-LM config at dp 2 and under plain accelerate with as many
processes as the Megatron run has data-parallel ranks x micro batches):

    python accelerate_schedule_script.py OUT.pt --batch_size B [--samples N]

Four runs from the same weights, each recording the loss of every batch (the mean over the
processes) and the lr after every update:
* linear:     get_linear_schedule_with_warmup(len(loader) * EPOCHS) stepped after every batch;
* accumulate: the same with gradient_accumulation_steps=2 (`// 2`; accelerate steps it on sync
              steps only);
* manual:     step_scheduler_with_optimizer=False and a schedule sized in updates (len(prepared
              loader) * EPOCHS) that the script steps once per update;
* onecycle:   OneCycleLR(total_steps=len(loader) * EPOCHS): 13 batches (26 samples) over 2 processes
              make 7 updates an epoch, 14 steps for 13 -- accelerate's AcceleratedScheduler stops
              stepping it at total_steps (torch's OneCycleLR raises on one step more); it cycles
              Adam's beta1 too.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.utils.data import DataLoader
from transformers import get_linear_schedule_with_warmup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny import tiny_hf_model  # noqa: E402

from hf_megatron import Accelerator  # noqa: E402  (the one changed import)

SEQ, EPOCHS = 16, 2


def run(accelerator, case: str, batch_size: int, samples: int) -> dict:
    accelerator.gradient_accumulation_steps = 2 if case == "accumulate" else 1
    accelerator.step_scheduler_with_optimizer = case != "manual"
    torch.manual_seed(0)
    model = tiny_hf_model("gpt2")
    generator = torch.Generator().manual_seed(1)
    data = [torch.randint(1, model.config.vocab_size, (SEQ,), generator=generator) for _ in range(samples)]
    loader = DataLoader(data, batch_size=batch_size,
                        collate_fn=lambda b: {"input_ids": torch.stack(b), "labels": torch.stack(b)})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    steps = len(loader) * EPOCHS // accelerator.gradient_accumulation_steps  # the unprepared loader
    if case == "onecycle":
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=steps)  # cycles beta1
    elif case != "manual":
        scheduler = get_linear_schedule_with_warmup(optimizer, steps // 4, steps)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if case == "manual":  # in updates, from the prepared loader
        scheduler = get_linear_schedule_with_warmup(optimizer, 2, len(loader) * EPOCHS)
    scheduler = accelerator.prepare(scheduler)
    losses, lrs, used = [], [scheduler.get_last_lr()[0]], []
    model.train()
    for _ in range(EPOCHS):
        for batch in loader:
            with accelerator.accumulate(model):
                used.append(optimizer.param_groups[0]["lr"])
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:  # the Megatron config clips at 1.0 (megatron_lm_gradient_clipping)
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                if case != "manual" or accelerator.sync_gradients:
                    scheduler.step()
                optimizer.zero_grad()
            losses.append(accelerator.reduce(loss.detach(), "mean").item())
            if accelerator.sync_gradients:
                lrs.append(scheduler.get_last_lr()[0])
    return {"losses": losses, "lrs": lrs, "used": used, "steps": steps, "beta1": optimizer.param_groups[0]["betas"][0]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--batch_size", type=int, required=True)
    parser.add_argument("--samples", type=int, default=26)  # 13 batches of 2: odd, the last process pads
    args = parser.parse_args()
    accelerator = Accelerator()
    result = {"distributed_type": str(accelerator.distributed_type), "num_processes": accelerator.num_processes}
    for case in ("linear", "accumulate", "manual", "onecycle"):
        result[case] = run(accelerator, case, args.batch_size, args.samples)
        accelerator.free_memory()
    if accelerator.is_main_process:
        torch.save(result, args.out)


if __name__ == "__main__":
    main()

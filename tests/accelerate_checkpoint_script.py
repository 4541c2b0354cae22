"""An accelerate script that checkpoints the way accelerate's docs show (tests/test_accelerate_user.py
runs it under `accelerate launch` with a Megatron-LM config and as `python` with plain accelerate):

    python accelerate_checkpoint_script.py OUT.pt --batch_size B

`Accelerator(gradient_accumulation_steps=2)` with `accelerator.accumulate(model)`, clipping and a
transformers cosine schedule sized from the unprepared loader; a `register_for_checkpointing` counter and a save pre-hook;
`ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2)` with `save_state()` every
second update; then, as a resumed run would, a fresh model / optimizer / schedule prepared again,
`load_state()` of a mid-epoch checkpoint and `skip_first_batches` for the rest of the epoch; and
`load_state()` without a folder (the newest checkpoint).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from accelerate.utils import ProjectConfiguration
from torch.utils.data import DataLoader
from transformers import get_cosine_schedule_with_warmup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny import tiny_hf_model  # noqa: E402

from hf_megatron import Accelerator  # noqa: E402  (the one changed import)

SAMPLES, SEQ, ACCUMULATE = 48, 16, 2
UPDATES = 6  # global batches of 4 samples, 2 per update


class Counter:
    """A user object with state_dict / load_state_dict: what register_for_checkpointing takes."""

    def __init__(self):
        self.batches = 0

    def state_dict(self):
        return {"batches": self.batches}

    def load_state_dict(self, saved):
        self.batches = saved["batches"]


def prepared(accelerator, batch_size: int):
    model = tiny_hf_model("gpt2")
    generator = torch.Generator().manual_seed(1)
    data = [torch.randint(1, model.config.vocab_size, (SEQ,), generator=generator) for _ in range(SAMPLES)]
    loader = DataLoader(data, batch_size=batch_size, collate_fn=lambda b: {"input_ids": torch.stack(b),
                                                                          "labels": torch.stack(b)})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    # sized as accelerate's examples size it, from the loader before prepare: accelerate steps the schedule
    # once per batch of this loader (num_processes -- under Megatron dp x num_micro_batches -- steps an update);
    # the warmup one update's worth of them
    steps = len(loader) // ACCUMULATE
    scheduler = get_cosine_schedule_with_warmup(optimizer, steps // UPDATES, steps)
    return accelerator.prepare(model, optimizer, loader, scheduler)


def train(accelerator, counter, model, optimizer, loader, scheduler, save: bool) -> dict:
    losses, lrs, norms, updates = [], [], [], 0
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), 1.0).item())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        counter.batches += 1
        losses.append(loss.item())
        lrs.append(scheduler.get_last_lr()[0])
        if accelerator.sync_gradients:
            updates += 1
            if save and updates % 2 == 0:
                accelerator.save_state()
    return {"losses": losses, "lrs": lrs, "norms": norms}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--batch_size", type=int, required=True)
    args = parser.parse_args()
    project = ProjectConfiguration(project_dir=os.path.abspath("proj"), automatic_checkpoint_naming=True,
                                   total_limit=2)
    accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATE, project_config=project)
    counter, hooked = Counter(), []
    accelerator.register_for_checkpointing(counter)
    accelerator.register_save_state_pre_hook(lambda models, weights, folder: hooked.append(os.path.basename(folder)))
    objects = prepared(accelerator, args.batch_size)
    result = {"full": train(accelerator, counter, *objects, save=True)}
    accelerator.wait_for_everyone()
    result["kept"] = sorted(os.listdir("proj/checkpoints"))
    result["hooked"], result["save_iteration"] = hooked, accelerator.save_iteration

    # a resumed run: fresh objects, the checkpoint after 4 updates (8 batches), the rest of the epoch
    objects = accelerator.free_memory(*objects)
    model, optimizer, loader, scheduler = prepared(accelerator, args.batch_size)
    counter.batches = -1
    accelerator.load_state("proj/checkpoints/checkpoint_1")
    result["counter_mid"] = counter.batches
    skipped = accelerator.skip_first_batches(loader, counter.batches)
    result["resumed"] = train(accelerator, counter, model, optimizer, skipped, scheduler, save=False)
    counter.batches = -1
    accelerator.load_state()  # the newest: checkpoint_2, after the epoch
    result["counter_newest"] = counter.batches
    if accelerator.is_main_process:
        torch.save(result, args.out)


if __name__ == "__main__":
    main()

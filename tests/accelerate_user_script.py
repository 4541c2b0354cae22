"""A plain accelerate training script (tests/test_accelerate_user.py runs it twice: under
`accelerate launch` with a Megatron-LM config, and as `python` with plain accelerate).

    python accelerate_user_script.py OUT.pt --batch_size B [--arch gpt2] [--case heads|dummy_loader]

Dynamic padding (each batch padded to its longest sample, attention_mask 0 and labels -100 on
the padding: lengths that are not a multiple of the tensor-parallel size), the loss and
`accelerator.clip_grad_norm_`'s norm of each step, eval loss and logits, `accelerator.device`,
transformers' `use_cache=False` / `return_dict=False` switches;
trained three times from the same weights: the usual `prepare(model, optimizer, ...)`, the optimizer
built on the prepared model's parameters (`model = prepare(model); AdamW(model.parameters())`), and
the samples as an IterableDataset.
`--case` makes a user mistake instead (what the user sees is checked): a GPT-2 whose n_head the
tensor-parallel degree does not divide, or accelerate's MegatronLMDummyDataLoader.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny import tiny_hf_model  # noqa: E402

from hf_megatron import Accelerator  # noqa: E402  (the one changed import)

LENGTHS = [15, 9, 13, 11, 7, 13, 12, 10, 14, 9, 11, 15, 11, 14, 8, 15]  # batches of 4: longest 15, 13, 15, 15
STEPS = 3


def samples(vocab: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(1, vocab, (n,), generator=generator) for n in LENGTHS]


def collate(batch: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' DataCollatorWithPadding + labels: pad to the longest in the batch."""
    seq = max(len(x) for x in batch)
    ids = torch.zeros(len(batch), seq, dtype=torch.long)
    mask = torch.zeros(len(batch), seq, dtype=torch.long)
    for i, x in enumerate(batch):
        ids[i, : len(x)], mask[i, : len(x)] = x, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class Stream(torch.utils.data.IterableDataset):
    """The samples as a streaming dataset (no length, no sampler)."""

    def __init__(self, items):
        self.items = items

    def __iter__(self):
        return iter(self.items)


def train(accelerator, arch: str, batch_size: int, optimizer_after_model: bool, iterable: bool = False) -> dict:
    model = tiny_hf_model(arch)
    data = samples(model.config.vocab_size)
    loader = DataLoader(Stream(data) if iterable else data, batch_size=batch_size, collate_fn=collate)
    if optimizer_after_model:
        model = accelerator.prepare(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        optimizer, loader = accelerator.prepare(optimizer, loader)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    losses, norms, batches = [], [], iter(loader)
    for _ in range(STEPS):
        batch = next(batches)
        loss = model(**batch, use_cache=False).loss  # transformers' switches a training script passes
        accelerator.backward(loss)
        norms.append(accelerator.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.eval()
    batch = next(batches)
    with torch.no_grad():
        loss_only = model(**batch, return_dict=False)[0]  # Megatron-LM: micro batches, no logits; a tuple
        plugin = getattr(accelerator.state, "megatron_lm_plugin", None)
        if plugin is not None:
            plugin.return_logits = True
        out = model(**batch)
        if plugin is not None:
            plugin.return_logits = False
    return {"losses": losses, "norms": norms, "eval_loss": out.loss.item(), "eval_loss_only": loss_only.item(),
            "logits": out.logits.cpu(), "mask": batch["attention_mask"].cpu()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--batch_size", type=int, required=True)
    parser.add_argument("--arch", default="gpt2")
    parser.add_argument("--case", choices=["heads", "dummy_loader"])
    args = parser.parse_args()
    accelerator = Accelerator()
    if args.case == "heads":
        accelerator.prepare(tiny_hf_model("gpt2", n_embd=48, n_head=3))
    if args.case == "dummy_loader":
        from accelerate.utils import MegatronLMDummyDataLoader
        MegatronLMDummyDataLoader(data_path=["corpus_text_document"], splits_string="949,50,1", seq_length=16)
    result = {"device": str(accelerator.device), "distributed_type": str(accelerator.distributed_type),
              "usual": train(accelerator, args.arch, args.batch_size, optimizer_after_model=False)}
    accelerator.free_memory()
    result["optimizer_after_model"] = train(accelerator, args.arch, args.batch_size, optimizer_after_model=True)
    accelerator.free_memory()
    result["iterable"] = train(accelerator, args.arch, args.batch_size, optimizer_after_model=False, iterable=True)
    if accelerator.is_main_process:
        torch.save(result, args.out)


if __name__ == "__main__":
    main()

"""Resume with the training engine: train N steps, save, rebuild everything from scratch, load,
continue -- the losses equal those of an uninterrupted run, bit for bit.  One process here
(dropout on, fp32); tp=2 x pp=2 with virtual pipeline chunks runs in test_convert_dist.py."""
from __future__ import annotations

import torch

from hf_megatron.config import ModelConfig
from hf_megatron.parallel import state
from hf_megatron.training.checkpoint import load_checkpoint, save_checkpoint
from hf_megatron.training.trainer import (TrainingConfig, build_model, build_optimizer, build_scheduler,
                                          setup_parallel, split_batch, train_step)
from tiny import VOCAB, engine_batch, tiny_config

STEPS, SAVE_AT = 4, 2


def batches(steps: int = STEPS) -> list[dict]:
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (4, 12), generator=gen)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def training_config(**overrides) -> TrainingConfig:
    fields = dict(micro_batch_size=2, global_batch_size=4, train_iters=STEPS, lr=3e-3, min_lr=3e-4,
                  lr_warmup_iters=2, lr_decay_style="cosine", clip_grad=0.5, seed=7)
    fields.update(overrides)
    return TrainingConfig(**fields)


def model_config(**overrides) -> ModelConfig:
    return ModelConfig.from_hf(tiny_config("gpt2", resid_pdrop=0.1, attn_pdrop=0.1, embd_pdrop=0.1, **overrides))


def run_and_resume(cfg: TrainingConfig, config: ModelConfig, save_dir, ckpt_format: str = "torch") -> tuple[list, list]:
    """(uninterrupted losses, losses of a run saved at SAVE_AT (in `ckpt_format`) and resumed in fresh objects)."""
    data = batches()

    def fresh(seed):
        setup_parallel(training_config(**{**cfg.__dict__, "seed": seed}))
        chunks = build_model(config, cfg)
        optimizer = build_optimizer(chunks, cfg)
        return chunks, optimizer, build_scheduler(optimizer, cfg)

    def train(objects, steps):
        chunks, optimizer, scheduler = objects
        return [train_step(chunks, optimizer, scheduler, split_batch(engine_batch(b), cfg))["loss"] for b in steps]

    uninterrupted = train(fresh(cfg.seed), data)
    first = fresh(cfg.seed)
    interrupted = train(first, data[:SAVE_AT])
    save_checkpoint(save_dir, SAVE_AT, *first, ckpt_format=ckpt_format)
    second = fresh(cfg.seed + 1)  # other init, other RNG: everything must come from the checkpoint
    assert load_checkpoint(save_dir, *second) == SAVE_AT
    return uninterrupted, interrupted + train(second, data[SAVE_AT:])


def test_resume_matches_uninterrupted_run(tmp_path):
    state.reset()
    uninterrupted, resumed = run_and_resume(training_config(), model_config(), tmp_path)
    assert resumed == uninterrupted
    assert len(set(uninterrupted)) == STEPS  # the losses move: the comparison is not vacuous

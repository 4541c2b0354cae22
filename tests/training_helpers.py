"""Shared pieces of the training tests: data, the transformers+torch reference run, and our run.

The reference is independent of hf_megatron's training code: a transformers model, torch's
AdamW (no weight decay on 1-D params), `torch.nn.utils.clip_grad_norm_`, and megatron-core's
own `OptimizerParamScheduler` for the learning rate.
"""
from __future__ import annotations

import torch

from hf_megatron.architectures import mcore_to_hf
from tiny import VOCAB, engine_batch, merge_shards, tiny_hf_model

STEPS, GLOBAL_BATCH, MICRO_BATCH, SEQ = 20, 8, 2, 16
HP = dict(lr=3e-3, min_lr=3e-4, lr_warmup_iters=3, lr_decay_iters=STEPS, lr_decay_style="cosine",
          weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=0.5)


def make_batches(steps: int = STEPS, seed: int = 7) -> list[dict]:
    """Global batches; a few -100 labels so token counts differ between micro batches."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen)
        labels = ids.clone()
        ignore = torch.rand(GLOBAL_BATCH, SEQ, generator=gen) < 0.2
        labels[ignore] = -100
        batches.append({"input_ids": ids, "labels": labels})
    return batches


def megatron_core_scheduler(optimizer, hp: dict):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    return OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=hp["lr"], min_lr=hp["min_lr"],
                                   lr_warmup_steps=hp["lr_warmup_iters"], lr_decay_steps=hp["lr_decay_iters"],
                                   lr_decay_style=hp["lr_decay_style"], start_wd=hp["weight_decay"],
                                   end_wd=hp["weight_decay"], wd_incr_steps=1, wd_incr_style="constant")


def reference_run(arch: str, batches: list[dict], hp: dict = HP, **overrides):
    """(losses, grad norms before clipping, final HF state dict) of plain transformers + torch training."""
    model = tiny_hf_model(arch, **overrides)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and not n.endswith("bias")]
    no_decay = [p for n, p in model.named_parameters() if p.ndim == 1 or n.endswith("bias")]
    optimizer = torch.optim.AdamW([{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}],
                                  lr=hp["lr"], betas=(hp["adam_beta1"], hp["adam_beta2"]), eps=hp["adam_eps"])
    scheduler = megatron_core_scheduler(optimizer, hp)
    losses, norms = [], []
    for batch in batches:
        optimizer.zero_grad()
        total_tokens = (batch["labels"][:, 1:] != -100).sum().item()
        loss_sum = 0.0
        for start in range(0, GLOBAL_BATCH, MICRO_BATCH):
            ids, labels = (batch[k][start:start + MICRO_BATCH] for k in ("input_ids", "labels"))
            n = (labels[:, 1:] != -100).sum().item()
            loss = model(input_ids=ids, labels=labels).loss  # mean over this micro batch's tokens
            (loss * n / total_tokens).backward()
            loss_sum += loss.item() * n
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), hp["clip_grad"]).item())
        optimizer.step()
        scheduler.step(1)
        losses.append(loss_sum / total_tokens)
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def global_state_dict(chunks) -> dict[str, torch.Tensor]:
    """This rank's chunk weights (names carry global layer numbers; fp32 copies)."""
    out = {}
    for chunk in chunks:
        for name, tensor in chunk.state_dict().items():
            if name == "output_layer.weight" and chunk.config.tie_word_embeddings:
                name = "output_layer.weight(tied copy)"
            out[name] = tensor.detach().float().clone()
    return out


def merge_ranks(per_rank: list[dict], coords: list[dict], config) -> dict[str, torch.Tensor]:
    """Per-rank global_state_dicts (dp rank 0 of each tp/pp position) -> full mcore dict."""
    by_name: dict[str, dict[int, torch.Tensor]] = {}
    for sd, c in zip(per_rank, coords):
        if c["dp"] != 0:
            continue
        for name, tensor in sd.items():
            by_name.setdefault(name, {})[c["tp"]] = tensor
    full = {}
    for name, shards in by_name.items():
        ordered = [{"x": shards[t]} for t in sorted(shards)]
        key = name.replace("(tied copy)", "").strip()
        merged = merge_shards([{key: o["x"]} for o in ordered], config)
        full[name] = merged[key]
    return full


def to_hf(full: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    return dict(mcore_to_hf(lambda n: full[n], config))


LAYERS = 4  # pp=2 x vpp=2 interleaving needs 4 model chunks


def layer_kwargs(arch: str) -> dict:
    return {"n_layer": LAYERS} if arch == "gpt2" else {"num_hidden_layers": LAYERS}


def training_config(layout: dict, hp: dict = HP, **extra):
    from hf_megatron.training import TrainingConfig
    return TrainingConfig(micro_batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH, train_iters=STEPS,
                          tensor_model_parallel_size=layout.get("tp", 1),
                          pipeline_model_parallel_size=layout.get("pp", 1),
                          virtual_pipeline_model_parallel_size=layout.get("vpp"),
                          sequence_parallel=layout.get("sp", False),
                          use_distributed_optimizer=layout.get("zero", False), **{**hp, **extra})


def our_run(arch: str, layout: dict, batches: list[dict], keep_alive: list | None = None,
            hf_overrides: dict | None = None, deferred: bool = False, **extra) -> dict:
    """Train with hf_megatron in the current process group; losses and this rank's weights.
    `hf_overrides` go to the HF config (e.g. dropout), `extra` to TrainingConfig; `deferred`: step
    with training/deferred.py (each step read after the next one's forward and backward)."""
    from hf_megatron.parallel import state
    from hf_megatron.training import build_model, build_optimizer, build_scheduler, setup_parallel, split_batch, \
        train_step
    cfg = training_config(layout, **extra)
    grid = setup_parallel(cfg)
    chunks = build_model(tiny_hf_model(arch, **layer_kwargs(arch), **(hf_overrides or {})), cfg)
    if keep_alive is not None:
        keep_alive.append(chunks)  # the pipeline caches schedules by chunk id: no id reuse
    optimizer = build_optimizer(chunks, cfg)
    scheduler = build_scheduler(optimizer, cfg)
    if deferred:
        from hf_megatron.training.deferred import DeferredSteps
        runner = DeferredSteps(chunks, optimizer, scheduler)
        stats = [s for b in batches if (s := runner.step(split_batch(engine_batch(b), cfg))) is not None]
        stats.append(runner.finish())
    else:
        stats = [train_step(chunks, optimizer, scheduler, split_batch(engine_batch(b), cfg)) for b in batches]
    state_numel = sum(v["exp_avg"].numel() for v in optimizer.optimizer.state.values())
    result = {"losses": [s["loss"] for s in stats], "stats": stats, "state": global_state_dict(chunks),
              "adam_state_numel": state_numel, "param_numel": sum(p.numel() for p in optimizer.model_params),
              "coords": dict(grid.coords), "config": chunks[0].config}
    state.reset()
    return result


def train_layouts(rank: int, world: int, jobs: list[tuple[str, dict]], batches: list[dict]) -> list[dict]:
    """Spawned worker: several (arch, layout) runs one after another in one process group."""
    keep_alive = []
    return [our_run(arch, layout, batches, keep_alive) for arch, layout in jobs]

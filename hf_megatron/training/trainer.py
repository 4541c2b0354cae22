"""`train_step`: one optimizer step over a global batch, in any tp / pp / dp layout.

    cfg = TrainingConfig(micro_batch_size=2, global_batch_size=8, lr=3e-4, ...)
    setup_parallel(cfg)                        # groups + RNG streams (after init_process_group)
    chunks = build_model(hf_model_or_config, cfg)
    optimizer, scheduler = build_optimizer(chunks, cfg), build_scheduler(optimizer, cfg)
    for batch in data:                         # the *global* batch, [global_batch_size, s]
        stats = train_step(chunks, optimizer, scheduler, split_batch(batch, cfg))

Micro batches hold `input_ids` and aligned `targets` ([b, s] each: token t is scored against
targets[t], -100 = not scored), as the data path cuts them from windows of s + 1 tokens; the
shift happens there, once.  (A transformers-style batch with `labels` converts through
`hf_megatron.model.gpt.shift_labels`.)

Loss normalisation.  The step's loss is  L = (sum of per-token losses) / N  over the whole
global batch, N = number of target tokens (targets != -100) on all
micro batches of all dp ranks.  N is all-reduced over dp *before* backward, every micro batch
back-propagates  loss_sum * S / N  (S = fp16 loss scale, else 1), and gradients are then
SUMMED over dp -- so any split of the global batch gives the gradient of the same L.

Order after backward (Megatron's finalize_model_grads): all grads summed over dp (per bucket of
the grad buffer; with --overlap-grad-reduce the buckets were launched during the last micro
batch's backward and are only waited for here; with the distributed optimizer a reduce-scatter,
each dp rank then holds its shard), sequence-parallel grads all-reduced over TP, tied embedding
grads over the embedding group -- elementwise sums, so a shard stays right -- then unscale / inf
check / clip / AdamW / cast back (optimizer; the distributed optimizer all-gathers the updated
params), then the LR schedule advances (only after a real update).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..conversion.hf_writer import DTYPES
from ..loading import build_model_chunks
from ..parallel import pipeline, state
from ..parallel.data_parallel import allreduce_tensors, grad_of, micro_batches_for_rank
from ..parallel.random import model_parallel_seed
from .config import TrainingConfig  # noqa: F401  (re-exported: code imports it from here)
from .distributed_optimizer import DistributedOptimizer
from .loss_scaler import LossScaler
from .optimizer import MixedPrecisionOptimizer
from .schedules import LRScheduler


def setup_parallel(cfg: TrainingConfig) -> state.ParallelState:
    """Build the rank grid for cfg's degrees and seed the RNG streams."""
    grid = state.initialize(tp=cfg.tensor_model_parallel_size, pp=cfg.pipeline_model_parallel_size)
    model_parallel_seed(cfg.seed)
    return grid


def build_model(source, cfg: TrainingConfig, **gpt_kwargs) -> list:
    """This rank's model chunks (pretrained HF weights, or a fresh init for a ModelConfig)."""
    gpt_kwargs.setdefault("compile", cfg.compile_options(gpt_kwargs.get("device")))
    gpt_kwargs.setdefault("fused_loss", cfg.cross_entropy_loss_fusion)
    if cfg.fp8_format is not None:
        gpt_kwargs.setdefault("fp8", (cfg.fp8_format, cfg.fp8_recipe))
        if cfg.first_last_layers_bf16:
            gpt_kwargs.setdefault("fp8_bf16_layers", (cfg.num_layers_at_start_in_bf16, cfg.num_layers_at_end_in_bf16))
    gpt_kwargs.setdefault("gradient_accumulation_fusion", cfg.gradient_accumulation_fusion)
    return build_model_chunks(
        source, vpp=cfg.virtual_pipeline_model_parallel_size or 1, seed=cfg.seed,
        sequence_parallel=cfg.sequence_parallel, recompute=cfg.recompute_granularity,
        dtype=cfg.params_dtype, **gpt_kwargs)


def build_optimizer(chunks, cfg: TrainingConfig, groups: list[dict] | None = None) -> MixedPrecisionOptimizer:
    """`groups`: the caller's parameter groups (params of `chunks` + per-group options such as
    weight_decay); default: Megatron's two groups (see optimizer.param_groups)."""
    if cfg.fp16:
        dynamic = cfg.loss_scale is None
        scaler = LossScaler(cfg.initial_loss_scale if dynamic else cfg.loss_scale, dynamic=dynamic,
                            min_scale=cfg.min_loss_scale, window=cfg.loss_scale_window, hysteresis=cfg.hysteresis)
    elif cfg.loss_scale is not None and (cfg.bf16 or cfg.use_distributed_optimizer):
        # megatron-core's get_megatron_optimizer: a constant grad scaler whenever --loss-scale is given to a
        # mixed-precision or distributed optimizer (bf16 too: an overflowing step is skipped, as in fp16)
        scaler = LossScaler(cfg.loss_scale)
    else:  # fp32 without the distributed optimizer: megatron-core's FP32Optimizer has no scaler
        scaler = LossScaler()
    kwargs = dict(lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                  clip_grad=cfg.clip_grad, loss_scaler=scaler, overlap_grad_reduce=cfg.overlap_grad_reduce,
                  bucket_size=cfg.ddp_bucket_size, groups=groups,
                  precision_aware=True if cfg.use_precision_aware_optimizer else None,  # None: csrc AdamW on CUDA
                  moment_dtypes=(DTYPES[cfg.exp_avg_dtype], DTYPES[cfg.exp_avg_sq_dtype]))
    if cfg.use_distributed_optimizer:
        return DistributedOptimizer(chunks, overlap_param_gather=cfg.overlap_param_gather, **kwargs)
    return MixedPrecisionOptimizer(chunks, **kwargs)


def build_scheduler(optimizer, cfg: TrainingConfig) -> LRScheduler:
    return LRScheduler(optimizer, cfg.lr, cfg.min_lr, cfg.warmup_iters, cfg.lr_decay_horizon,
                       cfg.lr_decay_style, samples_per_iter=cfg.micro_batch_size * state.get_state().dp
                       * cfg.num_micro_batches(), weight_decay=cfg.weight_decay, train_iters=cfg.train_horizon)


def split_batch(batch: dict, cfg: TrainingConfig) -> list[dict]:
    """The global batch -> this dp rank's micro batches (checks the global batch size)."""
    grid = state.get_state()
    size = next(v for v in batch.values() if isinstance(v, torch.Tensor)).shape[0]
    expected = cfg.micro_batch_size * grid.dp * cfg.num_micro_batches(grid.dp)
    if size != expected:
        raise ValueError(f"batch has {size} samples, expected global_batch_size={expected}")
    return micro_batches_for_rank(batch, cfg.micro_batch_size, grid.rank_in("dp"), grid.dp)


def count_target_tokens(micro_batches: list[dict]) -> torch.Tensor:
    """Tokens that carry a loss: targets != -100."""
    return sum((mb["targets"] != -100).sum() for mb in micro_batches)


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def sync_sequence_parallel_grads(params) -> None:
    """SP params (norms, row biases) see one sequence shard per TP rank: sum over TP."""
    grads = [grad_of(p) for p in params if getattr(p, "sequence_parallel", False)]
    allreduce_tensors([g for g in grads if g is not None], state.tp_group())


def train_step(chunks, optimizer: MixedPrecisionOptimizer, scheduler: LRScheduler | None,
               micro_batches: list[dict], *, accumulate: bool = False, fresh: bool = True,
               loss_weight: float = 1.0) -> dict[str, Any]:
    """One optimizer step over this rank's micro batches (see the module docstring).

    Gradient accumulation over several calls (accelerate's `gradient_accumulation_steps` k):
    every call back-propagates `loss_weight` (1/k) x its own L; the first passes fresh=True (zero
    the grads), all but the last accumulate=True (stop after backward: no grad reduction, no
    update); the last reduces the summed grads and steps once.

    Returns {"loss", "grad_norm" (None when skipped), "lr", "skipped", "loss_scale", "num_tokens", "next_lr",
    "next_loss_scale"}; `lr` and `loss_scale` are the values this step used, `next_lr` / `next_loss_scale`
    the lr after its schedule update and the scale after its scaler update (the ones the log shows, as
    Megatron-LM's).  (training/deferred.py runs the same three parts with
    each step's read moved after the next step's forward and backward.)"""
    step = queue_forward_backward(chunks, optimizer, micro_batches, fresh=fresh, loss_weight=loss_weight,
                                  reduce=not accumulate)
    if accumulate:
        return read_step(step, optimizer, None)
    queue_update(step, chunks, optimizer)
    return read_step(step, optimizer, scheduler)


class QueuedStep:
    """One step's device-side results: `totals` = [loss sum, target tokens] (+ [grad norm, skipped]
    when the update was queued without a host sync), `launched` = launch_step's result, and the
    loss scale and lr it used.  `host` / `ready`: a pinned copy of `totals` and the CUDA event after
    it, when the read is deferred (`queue_update(..., copy=True)`)."""

    def __init__(self, totals: torch.Tensor, loss_scale: float) -> None:
        self.totals, self.loss_scale = totals, loss_scale
        self.launched, self.lr, self.host, self.ready = None, None, None, None


def queue_forward_backward(chunks, optimizer, micro_batches: list[dict], *, fresh: bool = True,
                           loss_weight: float = 1.0, reduce: bool = True) -> QueuedStep:
    """Zero the grads (`fresh`), then queue every micro batch's forward and backward; nothing is read
    on the host.  `reduce`: this is the step's last call (with overlap the grad buckets reduce
    during its last micro batch)."""
    grid = state.get_state()
    for chunk in chunks:
        if not chunk.training:  # after evaluate(); Module.train() walks every submodule (~1 ms of host
            chunk.train()       # time per step for GPT-2 medium's 274 modules, before the forward may start)
    if fresh:
        # overlap: buckets reduce in the last micro batch -- not when more calls accumulate into this step
        optimizer.zero_grad(num_micro_batches=len(micro_batches) if reduce else None)
    device = micro_batches[0]["targets"].device
    tokens = _all_reduce(count_target_tokens(micro_batches).to(device=device, dtype=torch.float64),
                         grid.group("dp"))
    loss_scale = optimizer.loss_scale
    # the token count stays on the device (a 0-d fp32 scale, the value a Python float would be
    # rounded to): no host sync before the forward, so it queues behind the previous step's update
    scale = (loss_scale * loss_weight / tokens.clamp(min=1.0)).to(torch.float32)
    out = pipeline.forward_backward(chunks, micro_batches, loss_scale=scale)
    loss_sum = _all_reduce(out["loss_sum"].detach().to(torch.float64).reshape(1).clone(), grid.group("dp"))
    return QueuedStep(torch.cat([loss_sum, tokens.reshape(1)]), loss_scale)


def queue_update(step: QueuedStep, chunks, optimizer, copy: bool = False) -> None:
    """Reduce the grads and queue the update (Megatron's finalize_model_grads, then the optimizer);
    `copy`: also queue a copy of the step's totals into pinned host memory and an event after it, so
    that `read_step` later waits for this step only, not for what was queued after it."""
    step.lr = _current_lr(optimizer)
    optimizer.finish_grad_sync()  # dp sum of the grad buffer (launched during backward with overlap)
    sync_sequence_parallel_grads(optimizer.model_params)
    pipeline.allreduce_embedding_grads(chunks)  # tied embeddings (fp32 main_grad)
    step.launched = optimizer.launch_step()  # queued without a host sync where it can be
    if isinstance(step.launched, torch.Tensor):  # [norm, skipped], read with the loss
        step.totals = torch.cat([step.totals, step.launched])
    if copy and step.totals.is_cuda:
        step.host = torch.empty(step.totals.shape, dtype=step.totals.dtype, pin_memory=True)
        step.host.copy_(step.totals, non_blocking=True)
        step.ready = torch.cuda.Event()
        step.ready.record()


def _current_lr(optimizer) -> float:
    return optimizer.param_groups[0]["lr"] if optimizer.param_groups else 0.0


def read_step(step: QueuedStep, optimizer, scheduler: LRScheduler | None) -> dict[str, Any]:
    """The step's stats, read on the host (the step's one sync), and the LR schedule advanced after a
    real update (before the next step's `queue_update` reads the lr).  An accumulating call (no
    update queued) reports its loss only."""
    if step.ready is not None:
        step.ready.synchronize()
        host = step.host.tolist()
    else:
        host = step.totals.tolist()
    loss_total, global_tokens = host[:2]
    # a global batch with no scored token: loss 0 (nothing to average), num_tokens 0 says so
    result = {"loss": loss_total / max(global_tokens, 1.0), "grad_norm": None,
              "lr": step.lr if step.lr is not None else _current_lr(optimizer),
              "skipped": False, "loss_scale": step.loss_scale, "num_tokens": int(global_tokens)}
    if step.launched is None:
        return result
    updated, grad_norm = optimizer.finish_step(step.launched, host[2:] or None)
    if updated and scheduler is not None:
        scheduler.step()
    # `next_lr`: the lr after this step's schedule update, what Megatron-LM's training_log prints as
    # "learning rate" (optimizer.param_groups' lr read after train_step stepped the scheduler)
    return {**result, "grad_norm": grad_norm, "skipped": not updated, "next_lr": _current_lr(optimizer),
            "next_loss_scale": optimizer.loss_scale}


@torch.no_grad()
def evaluate_totals(chunks, micro_batches: list[dict]) -> torch.Tensor:
    """[sum of per-token losses, scored tokens] over this dp group's micro batches (forward only, fp64,
    on the device): a mean over several global batches divides the summed totals once."""
    for chunk in chunks:
        chunk.eval()
    out = pipeline.forward_backward(chunks, micro_batches, forward_only=True)
    totals = torch.stack([out["loss_sum"].double(), out["num_tokens"].double()])
    return _all_reduce(totals, state.get_state().group("dp"))


def evaluate(chunks, micro_batches: list[dict]) -> float:
    """Mean per-token loss over this dp group's micro batches (forward only)."""
    totals = evaluate_totals(chunks, micro_batches)
    return (totals[0] / totals[1].clamp(min=1)).item()

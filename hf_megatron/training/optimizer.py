"""Mixed-precision AdamW with fp32 main weights, dynamic loss scaling and global-norm clipping.

Precision.  Model params may be bf16/fp16/fp32.  Each param gets
  * `p.main_grad`: an fp32 view into one contiguous grad buffer (parallel/grad_buffer.py); a
    post-accumulate-grad hook adds every micro batch's gradient into it and frees `p.grad`, so
    accumulation over micro batches is in fp32 and the dp sum runs on a few flat buckets (on one
    process, until a step has a second backward, the buffer is not allocated and the one
    backward's gradients stand for it, `_lazy_grad_buffer`: the same fp32 values once widened);
  * for bf16/fp16 params an fp32 *main* copy that the optimizer updates, cast back into p after
    the step; fp32 params are their own main params.

The update: on CUDA csrc's AdamW (training/fused_adamw.py), which reads bf16 grads as they are
and writes the bf16 copy in the same pass, with torch's fused AdamW's arithmetic; where it cannot
run (no CUDA, HF_MEGATRON_KERNELS=0, a failed build, other AdamW options) or `precision_aware` is
False, torch's fused AdamW kernel called directly; torch's `step()` otherwise.  `precision_aware`
True (--use-precision-aware-optimizer) asks for the csrc kernel and warns once when it cannot run.

Loss scaling (fp16).  The loss is multiplied by S before backward; after the grad reductions the
main grads are multiplied by 1/S.  If any grad on any rank is inf/nan the step is skipped; after
`hysteresis` such steps S <- max(S * 0.5, min_scale); after `window` clean steps in a row
S <- 2 S (Megatron's DynamicGradScaler).

Clipping.  ||g|| = sqrt(sum over unique params of ||g_p||^2), where the sum runs over the
model-parallel group (tp x pp) and a parameter replicated over TP (no `tensor_parallel_dim`)
is counted on tp rank 0 only; the last stage's copy of tied word embeddings is not counted
(it equals the first stage's after the embedding all-reduce).  Grads are already summed over
dp, so dp ranks hold identical norms.  If ||g|| > clip: g <- g * clip / (||g|| + 1e-6).
With torch's fused AdamW the factor is applied inside the AdamW kernel (its `grad_scale`), and
without an fp16 scaler the whole step is queued with no host sync (`launch_step`).

Weight decay is not applied to biases and norm weights (every 1-D parameter).

Checkpoint: `state_dict()` is Megatron-LM's optimizer entry (megatron_optimizer_layout.py): for
fp32 models FP32Optimizer's layout, for bf16/fp16 Float16OptimizerWithFloat16Params', state numbered
in megatron-core's param order; `load_state_dict` reads that, our previous layout, and (with a
parameter state) only hyper-parameters and scaler from either.

Megatron's distributed optimizer (training/distributed_optimizer.py) shards main weights and
Adam moments over dp by contiguous ranges of the grad buffer.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..parallel import pipeline, state
from ..parallel.grad_buffer import GradBuffer
from ..parallel.wgrad import is_fused
from ..kernels.adamw import sum_of_squares
from . import fused_adamw
from .loss_scaler import LossScaler
from .megatron_optimizer_layout import (group_fields, hyper_parameters, inner_state, match_groups, megatron_groups,
                                        to_megatron)
from .optimizer_state import MOMENTS, check_parameter_state, parameter_state_from


def param_groups(chunks, weight_decay: float) -> list[dict]:
    """Two groups: decayed (matrices) and not decayed (biases, norms), with megatron-core's group
    fields (wd_mult 1 / 0, ...: megatron_optimizer_layout.group_fields). Shared params once."""
    seen, decay, no_decay = set(), [], []
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            (no_decay if p.ndim == 1 or name.endswith(".bias") else decay).append(p)
    return [g for g in ({"params": decay, "weight_decay": weight_decay, **group_fields(no_decay=False)},
                        {"params": no_decay, "weight_decay": 0.0, **group_fields(no_decay=True)}) if g["params"]]


def make_adam(groups, lr: float, betas, eps: float, device: torch.device):
    """apex FusedAdam (AdamW mode) on CUDA when importable, else torch AdamW (fused on CUDA)."""
    if device.type == "cuda":
        try:
            from apex.optimizers import FusedAdam
            return FusedAdam(groups, lr=lr, betas=betas, eps=eps, adam_w_mode=True)
        except ImportError:
            return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=False)


def _counted_in_norm(chunk, name: str, p: torch.Tensor) -> bool:
    if getattr(p, "shared", False):
        return False
    tied_copy = (getattr(chunk, "output_layer", None) is not None and not chunk.pre_process
                 and chunk.config.tie_word_embeddings and name == "output_layer.weight")
    if tied_copy:
        return False
    return getattr(p, "tensor_parallel_dim", None) is not None or state.tp_rank() == 0


class MixedPrecisionOptimizer:
    """AdamW over the params of this rank's model chunks (see the module docstring).

    Gradients live in a `GradBuffer` (parallel/grad_buffer.py): one fp32 buffer, every param's
    `main_grad` a view of it, summed over dp by bucket (`overlap_grad_reduce`: launched during
    the last micro batch's backward).  The inner AdamW steps `main_params` (aligned lists:
    `main_params[i]` is updated with `_main_grads()[i]` and cast back into `_model_views[i]`,
    None where the main tensor is the model tensor itself).  `DistributedOptimizer` keeps the
    same step, over this dp rank's shard."""

    sharded = False  # DistributedOptimizer: state is per dp shard (distrib_optim.pt)

    def __init__(self, chunks, lr: float = 1e-4, weight_decay: float = 0.01, betas=(0.9, 0.999), eps: float = 1e-8,
                 clip_grad: float = 1.0, loss_scaler: LossScaler | None = None, overlap_grad_reduce: bool = False,
                 bucket_size: int | None = None, groups: list[dict] | None = None,
                 precision_aware: bool | None = None,
                 moment_dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32)) -> None:
        self.chunks = list(chunks)
        # the dtypes exp_avg / exp_avg_sq are kept in between steps (--exp-avg-dtype / --exp-avg-sq-dtype):
        # computed in fp32 by every AdamW path, rounded to nearest when stored, fp32 in checkpoints
        self.moment_dtypes = tuple(moment_dtypes)
        # csrc's AdamW where it can run (None: silently; True: warn when it cannot); False: torch's AdamW
        self.precision_aware = precision_aware
        self.clip_grad = clip_grad
        self.scaler = loss_scaler or LossScaler()
        groups = param_groups(self.chunks, weight_decay) if groups is None else [  # caller's groups kept
            {**group_fields(no_decay=g.get("weight_decay", weight_decay) == 0.0), **g} for g in groups]
        self.model_params = [p for g in groups for p in g["params"]]
        # megatron-core's param order of each group, for the checkpoint (megatron_optimizer_layout.py)
        self.megatron_order = megatron_groups(self.chunks, [g["params"] for g in groups])
        self.dp_group = state.get_state().group("dp")
        self.grad_buffer = GradBuffer(self.chunks, self.model_params, self.dp_group, bucket_size,
                                      overlap=overlap_grad_reduce, reduce_scatter=self.sharded,
                                      shard_params=self.sharded, alone=pipeline.tied_embedding_params(self.chunks),
                                      lazy=self._lazy_grad_buffer())
        counted = {id(p) for c in self.chunks for n, p in c.named_parameters() if _counted_in_norm(c, n, p)}
        inner_groups = self._build_main_params(groups, counted)
        # (model views, their main params) of the low-precision params, for the cast back after each
        # update: fixed from here on (checkpoint loads copy into these tensors)
        halves = self._halves()
        self._cast_back = ([v for _, v in halves], [m for m, _ in halves])
        device = self.model_params[0].device if self.model_params else torch.device("cpu")
        self.optimizer = make_adam(inner_groups, lr, betas, eps, device)

    def _lazy_grad_buffer(self) -> bool:
        """The fp32 grad buffer may wait for a step with a second backward (grad_buffer.py): one
        process (nothing to reduce), no loss scale (unscaling must run on fp32 grads), no
        gradient-accumulation fusion (its GEMMs write into main_grad) and not sharded."""
        alone = not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1
        fused_wgrad = any(is_fused(m) for c in self.chunks for m in c.modules())
        return alone and not self.scaler.active and not fused_wgrad and not self.sharded

    def _build_main_params(self, groups: list[dict], counted: set[int]) -> list[dict]:
        """fp32 main weights, one per param: the param itself when fp32, else a copy."""
        self.main_params, self._model_views, self.norm_mask = [], [], []
        self.fragments = [(p, 0, p.numel()) for p in self.model_params]  # (param, lo, hi): flat elements stepped here
        for p in self.model_params:
            low = p.dtype != torch.float32
            self.main_params.append(p.detach().clone().float() if low else p)
            self._model_views.append(p if low else None)
            self.norm_mask.append(id(p) in counted)
        main_of = {id(p): m for p, m in zip(self.model_params, self.main_params)}
        return [{**{k: v for k, v in g.items() if k != "params"}, "params": [main_of[id(p)] for p in g["params"]]}
                for g in groups]

    # ---------------------------------------------------------------- views
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def grads(self) -> list[torch.Tensor]:
        """Every model param's accumulated gradient: its fp32 `main_grad`, or the step's one
        backward's gradient while the grad buffer is not allocated (grad_buffer.py, lazy)."""
        return self.grad_buffer.gradients(self.model_params)

    def _main_grads(self) -> list[torch.Tensor]:
        """The gradients aligned with `main_params`."""
        return self.grads()

    def zero_grad(self, num_micro_batches: int | None = None) -> None:
        """Zero the grad buffer; `num_micro_batches` lets overlap_grad_reduce launch each bucket's
        reduction in the last micro batch (None: all reductions wait for `finish_grad_sync`)."""
        for p in self.model_params:
            p.grad = None
        self.grad_buffer.zero(num_micro_batches)

    def finish_grad_sync(self) -> None:
        """Wait for (or, without overlap, run) the dp reduction of every bucket."""
        self.grad_buffer.finish()

    # ---------------------------------------------------------------- step
    @torch.no_grad()
    def step(self) -> tuple[bool, float | None]:
        """Unscale, check inf/nan, clip, update, copy back. Returns (updated, grad_norm or None if skipped)."""
        return self.finish_step(self.launch_step())

    @torch.no_grad()
    def launch_step(self) -> torch.Tensor | tuple[bool, float | None]:
        """Queue the update; `finish_step` of the result gives step()'s (updated, grad_norm).

        With torch's fused AdamW and no fp16 loss scaler nothing is read on the host: the norm,
        the clip factor (the kernel's `grad_scale` = max((||g|| + 1e-6) / clip, 1): it divides
        each gradient by it as it reads it) and the skip on a non-finite norm (the kernel's
        `found_inf`: no update, no step count) stay on the device, and the result is the fp64
        tensor [||g||, skipped] for the caller to read in a sync it makes anyway (train_step reads
        it with the loss).  Otherwise the host decides as before and the result is the pair."""
        self.finish_grad_sync()
        grads = self._main_grads()
        kernel = self.precision_aware is not False and fused_adamw.usable(
            self.optimizer, self.main_params, grads, self._model_views, self.moment_dtypes)
        if self.precision_aware and not kernel:
            fused_adamw.warn_unusable()
        if not self._fused_adamw(grads) or self.scaler.active:
            return self._step_on_host(grads, kernel)
        flat = None
        if not kernel:
            grads, flat = self._widened(grads)
        norm = self.grad_norm_tensor(grads, flat)
        skipped = (~torch.isfinite(norm)).to(torch.float32)  # 0-d: AdamW subtracts it from each 0-d step count
        scale = ((norm + 1e-6) / self.clip_grad).clamp(min=1.0) if self.clip_grad and self.clip_grad > 0 else None
        self._update(grads, grad_scale=None if scale is None else scale.to(torch.float32).reshape(1),
                     found_inf=skipped, kernel=kernel)
        return torch.stack([norm, skipped.double()])

    @staticmethod
    def finish_step(launched, values: list[float] | None = None) -> tuple[bool, float | None]:
        """(updated, grad_norm or None) of a `launch_step` result; `values`: that tensor already
        read on the host (as a list)."""
        if isinstance(launched, tuple):
            return launched
        norm, skipped = launched.tolist() if values is None else values
        return (False, None) if skipped else (True, norm)

    def _fused_adamw(self, grads) -> bool:
        """torch's fused AdamW steps every group (its kernel takes grad_scale / found_inf tensors)."""
        return bool(grads) and all(g.get("fused") for g in self.optimizer.param_groups)

    def _widened(self, grads) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """torch's AdamW (and the host path's in-place clip) needs grads of the main weights' dtype:
        the lazy buffer's bf16 grads are copied into views of one fresh fp32 tensor by one
        `_foreach_copy_` (a multi-tensor kernel on CUDA, not a cast per param), freed after the step.
        Returns the grads and that tensor where it holds all of them (else None)."""
        low = [i for i, (g, m) in enumerate(zip(grads, self.main_params)) if g.dtype != m.dtype]
        if not low:
            return grads, None
        numels = [grads[i].numel() for i in low]
        flat = torch.empty(sum(numels), dtype=torch.float32, device=grads[low[0]].device)
        views = list(grads)
        for i, piece in zip(low, torch.split(flat, numels)):
            views[i] = piece.view(grads[i].shape)
        torch._foreach_copy_([views[i] for i in low], [grads[i] for i in low])
        return views, flat if len(low) == len(grads) else None

    def _step_on_host(self, grads, kernel: bool = False) -> tuple[bool, float | None]:
        flat = None
        if not kernel:
            grads, flat = self._widened(grads)
        if self.scaler.active:
            # fp16: unscale and look for inf/nan in one fused pass; every rank skips together
            found_inf = self._unscale_and_check(grads)
            self.scaler.update(found_inf)
            if found_inf:
                return False, None
        norm = self.grad_norm(grads, flat)
        if not math.isfinite(norm):
            # bf16 / fp32 (no scaler): a non-finite gradient shows in the global norm, which is
            # all-reduced over the model-parallel group and equal on dp ranks (grads are summed)
            return False, None
        coeff = self.clip_grad / (norm + 1e-6) if self.clip_grad and self.clip_grad > 0 else 1.0
        in_kernel = coeff < 1.0 and self._fused_adamw(grads)
        if coeff < 1.0 and not in_kernel:
            torch._foreach_mul_(grads, coeff)
        # torch's fused AdamW divides each gradient by `grad_scale` as it reads it (the hook
        # GradScaler uses): clipping costs no extra pass over the fp32 grads
        scale = torch.full((1,), 1.0 / coeff, dtype=torch.float32, device=grads[0].device) if in_kernel else None
        self._update(grads, grad_scale=scale, kernel=kernel)
        return True, norm

    def _update(self, grads, grad_scale=None, found_inf=None, kernel: bool = False) -> None:
        """AdamW on the main params with `grads` (fused kernel options `grad_scale` / `found_inf`),
        then the cast back into the model params: in one pass by csrc's AdamW (`kernel`), else
        torch's fused AdamW kernel called directly (training/fused_adamw.py) or torch's step, and
        a fused copy."""
        if kernel:
            # moments created in their dtypes and stored in them: no fp32 moments on the kernel path
            fused_adamw.step_(self.optimizer, self.main_params, grads, self._model_views, grad_scale, found_inf,
                              self.moment_dtypes)
            self._after_update()
            return
        self._store_moments(torch.float32)  # torch's AdamW steps fp32 moments
        if not fused_adamw.torch_step_(self.optimizer, self.main_params, grads, grad_scale, found_inf):
            self._torch_step(grads, grad_scale, found_inf)
        self._store_moments()
        views, mains = self._cast_back
        if views:
            torch._foreach_copy_(views, mains)  # cast back, fused
        self._after_update()

    def _store_moments(self, dtype: torch.dtype | None = None) -> None:
        """Every AdamW moment in `dtype`, default its --exp-avg(-sq)-dtype (fused_adamw.store_moments)."""
        if self.moment_dtypes != (torch.float32, torch.float32):
            fused_adamw.store_moments(self.optimizer, self.moment_dtypes, dtype)

    def _torch_step(self, grads, grad_scale=None, found_inf=None) -> None:
        """`optimizer.step()` with the grads set as the main params' `.grad` (and cleared after)."""
        for main, g in zip(self.main_params, grads):
            main.grad = g
        for name, value in (("grad_scale", grad_scale), ("found_inf", found_inf)):
            if value is not None:
                setattr(self.optimizer, name, value)
        try:
            self.optimizer.step()
        finally:
            self.optimizer.__dict__.pop("grad_scale", None)
            self.optimizer.__dict__.pop("found_inf", None)
            for main in self.main_params:
                main.grad = None

    def _after_update(self) -> None:
        """Hook for DistributedOptimizer (all-gather the updated params)."""

    def _unscale_and_check(self, grads) -> bool:
        """grads *= 1/S in place; True if any grad on any rank is inf/nan (one host sync)."""
        device = grads[0].device if grads else torch.device("cpu")
        found = torch.zeros(1, dtype=torch.float32, device=device)
        if grads:
            inv_scale = torch.full((1,), 1.0 / self.scaler.scale, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)  # every rank must skip together
        return bool(found.item())

    def _norm_groups(self) -> list:
        """Groups over which the squared norm is summed (dp ranks hold identical full grads)."""
        return [state.get_state().group("mp")]

    def grad_norm(self, grads=None, flat=None) -> float:
        return float(self.grad_norm_tensor(grads, flat))

    def grad_norm_tensor(self, grads=None, flat=None) -> torch.Tensor:
        """The global gradient norm as an fp64 0-d tensor on the grads' device (no host sync);
        `flat`: one tensor holding exactly `grads` (the lazy buffer's widened grads), if any."""
        grads = self._main_grads() if grads is None else grads
        counted = [g for g, keep in zip(grads, self.norm_mask) if keep and g.numel()]
        device = grads[0].device if grads else torch.device("cpu")
        total = torch.zeros((), dtype=torch.float64, device=device)
        every = counted and not self.sharded and len(counted) == len(self.model_params)
        whole = self.grad_buffer.data if self.grad_buffer.data is not None else flat
        if every and whole is not None:
            # every grad counts (tp = pp = 1): one norm of the whole buffer (its padding is zero) or
            # of the widened grads, instead of a norm per tensor stacked and summed
            total = torch.linalg.vector_norm(whole, dtype=torch.float64).pow(2)
        elif counted and self.grad_buffer.data is None:  # lazy: the one backward's gradients, any dtype
            total = sum_of_squares(counted, kernel=self.precision_aware is not False).to(device)
        elif counted:
            total = torch.stack(torch._foreach_norm(counted)).double().pow(2).sum()
        for group in self._norm_groups():
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(total, group=group)
        return total.sqrt()

    # ---------------------------------------------------------------- checkpoint
    def _halves(self):
        """(main, model view) of the low-precision params (fp32_from_fp16_params order)."""
        return [(m, v) for m, v in zip(self.main_params, self._model_views) if v is not None]

    def state_dict(self) -> dict:
        """Megatron-LM's optimizer entry: FP32Optimizer's layout for an fp32 model, else
        Float16OptimizerWithFloat16Params' (megatron_optimizer_layout.py)."""
        low = [view is not None for view in self._model_views]
        float16 = any(low) or self.scaler.dynamic
        scaler = self.scaler.state_dict() if self.scaler.active else None
        inner = self.optimizer.state_dict()
        inner["state"] = {i: {k: v.float() if k in MOMENTS else v for k, v in entry.items()}  # files: fp32
                          for i, entry in inner["state"].items()}
        step = next((int(e["step"]) for e in inner["state"].values() if e.get("step") is not None), 0)
        return to_megatron(inner, self.megatron_order[0], self.main_params, low, scaler, float16, step)

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Copy the model's (bf16 / fp16) weights into their fp32 main weights, as megatron-core's
        `reload_model_params`: Megatron-LM calls it when weights were loaded without optimizer state
        (--finetune, --no-load-optim), where the copies made when the optimizer was built are stale."""
        for main, view in zip(self.main_params, self._model_views):
            if view is not None:
                main.view(-1).copy_(view.reshape(-1))

    def load_state_dict(self, sd: dict, parameter_state: dict | None = None) -> None:
        """`sd` in Megatron-LM's layout (as `state_dict()` writes it) or our previous one; or, with a
        distributed optimizer's `parameter_state` (distrib_optim.pt), only hyper-parameters and
        scaler from `sd` (either layout, per-param state absent or ignored)."""
        if parameter_state is None:
            parameter_state = parameter_state_from([sd], self.model_params, self.megatron_order)
        self.load_parameter_state(sd, parameter_state)

    @torch.no_grad()
    def load_parameter_state(self, sd: dict, parameter_state: dict) -> None:
        """Main weights and AdamW moments of `fragments` from a parameter state (optimizer_state.py),
        hyper-parameters and loss scaler from `sd`."""
        saved_groups = match_groups(self.optimizer.param_groups, inner_state(sd)["param_groups"])
        check_parameter_state(parameter_state, self.model_params)
        if "param_groups" not in sd:  # FP32Optimizer's layout has no scaler
            self.scaler.load_state_dict(sd.get("grad_scaler") or {})
        starts = torch.tensor([0] + list(parameter_state["numels"])).cumsum(0).tolist()
        start_of = {id(p): s for p, s in zip(self.model_params, starts)}
        step, inner_state_ = parameter_state["step"], {}
        for index, ((p, lo, hi), main, view) in enumerate(zip(self.fragments, self.main_params, self._model_views)):
            at = start_of[id(p)]
            main.view(-1).copy_(parameter_state["param"][at + lo:at + hi])
            if view is not None:
                view.copy_(main)
            if step:
                inner_state_[index] = {"step": torch.tensor(float(step)),
                                       **{k: parameter_state[k][at + lo:at + hi].to(main.device).view_as(main).clone()
                                          for k in MOMENTS}}
        groups, index = [], 0
        for saved, live in zip(saved_groups, self.optimizer.param_groups):
            hyper = hyper_parameters({k: v for k, v in live.items() if k != "params"}, saved)
            groups.append({**hyper, "params": list(range(index, index + len(live["params"])))})
            index += len(live["params"])
        self.optimizer.load_state_dict({"state": inner_state_, "param_groups": groups})
        self._store_moments()

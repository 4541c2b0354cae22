"""Mixed-precision AdamW with fp32 main weights, dynamic loss scaling and global-norm clipping.

Precision.  Model params may be bf16/fp16.  Each such param gets
  * `p.main_grad`: an fp32 buffer; a post-accumulate-grad hook adds every micro batch's
    gradient into it and frees `p.grad`, so accumulation over micro batches is in fp32;
  * an fp32 *main* copy that the optimizer updates; after the step it is cast back into p.
fp32 params are their own main params and accumulate in `.grad`.

Loss scaling (fp16).  The loss is multiplied by S before backward; after the grad reductions the
main grads are multiplied by 1/S.  If any grad on any rank is inf/nan the step is skipped; after
`hysteresis` such steps S <- max(S * 0.5, min_scale); after `window` clean steps in a row
S <- 2 S (Megatron's DynamicGradScaler).

Clipping.  ||g|| = sqrt(sum over unique params of ||g_p||^2), where the sum runs over the
model-parallel group (tp x pp) and a parameter replicated over TP (no `tensor_parallel_dim`)
is counted on tp rank 0 only; the last stage's copy of tied word embeddings is not counted
(it equals the first stage's after the embedding all-reduce).  Grads are already summed over
dp, so dp ranks hold identical norms.  If ||g|| > clip: g <- g * clip / (||g|| + 1e-6).

Weight decay is not applied to biases and norm weights (every 1-D parameter).

ZeRO-1 (`distributed=True`): fp32 main weights and Adam moments exist only on the dp rank that
owns a parameter; the other dp ranks receive the updated (model-dtype) parameter by broadcast.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel import state
from ..parallel.data_parallel import ZeroShards, grad_of


def param_groups(chunks, weight_decay: float) -> list[dict]:
    """Two groups: decayed (matrices) and not decayed (biases, norms). Shared params once."""
    seen, decay, no_decay = set(), [], []
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            (no_decay if p.ndim == 1 or name.endswith(".bias") else decay).append(p)
    return [g for g in ({"params": decay, "weight_decay": weight_decay},
                        {"params": no_decay, "weight_decay": 0.0}) if g["params"]]


def make_adam(groups, lr: float, betas, eps: float, device: torch.device):
    """apex FusedAdam (AdamW mode) on CUDA when importable, else torch AdamW (fused on CUDA)."""
    if device.type == "cuda":
        try:
            from apex.optimizers import FusedAdam
            return FusedAdam(groups, lr=lr, betas=betas, eps=eps, adam_w_mode=True)
        except ImportError:
            return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=False)


class LossScaler:
    """Constant scale (fp32/bf16: 1) or Megatron's dynamic scaler for fp16."""

    def __init__(self, initial_scale: float = 1.0, dynamic: bool = False, min_scale: float = 1.0,
                 window: int = 1000, hysteresis: int = 2, backoff: float = 0.5, growth: float = 2.0) -> None:
        if initial_scale <= 0 or min_scale <= 0 or window < 1 or hysteresis < 1:
            raise ValueError("loss scaler: need initial/min scale > 0, window >= 1, hysteresis >= 1")
        self.scale, self.dynamic = float(initial_scale), dynamic
        self.min_scale, self.window, self.hysteresis = float(min_scale), window, hysteresis
        self.backoff, self.growth = backoff, growth
        self.good_steps, self.hysteresis_left = 0, hysteresis

    def update(self, found_inf: bool) -> None:
        if not self.dynamic:
            return
        if found_inf:
            self.good_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff, self.min_scale)
        else:
            self.good_steps += 1
            if self.good_steps == self.window:
                self.good_steps, self.hysteresis_left = 0, self.hysteresis
                self.scale *= self.growth

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.good_steps, "hysteresis_tracker": self.hysteresis_left}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])
        self.good_steps, self.hysteresis_left = int(sd["growth_tracker"]), int(sd["hysteresis_tracker"])


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

    `distributed=True` is ZeRO-1 over the dp group: a dp rank keeps fp32 main weights and Adam
    moments only for the params it owns (`ZeroShards`), steps those, and the updated model params
    are broadcast from their owners.  Its `state_dict` is then per dp rank
    (`state_dict_per_dp_rank`, which the checkpoint writer honours)."""

    def __init__(self, chunks, lr: float = 1e-4, weight_decay: float = 0.01, betas=(0.9, 0.999), eps: float = 1e-8,
                 clip_grad: float = 1.0, loss_scaler: LossScaler | None = None,
                 distributed: bool = False, groups: list[dict] | None = None) -> None:
        self.chunks = list(chunks)
        self.clip_grad = clip_grad
        self.scaler = loss_scaler or LossScaler()
        groups = param_groups(self.chunks, weight_decay) if groups is None else groups  # caller's groups kept
        self.model_params = [p for g in groups for p in g["params"]]
        self.zero = ZeroShards(self.model_params) if distributed else None
        self.state_dict_per_dp_rank = distributed
        self.owned = [self.zero is None or self.zero.owns(i) for i in range(len(self.model_params))]
        # fp32 main weights: the param itself when fp32; a copy for bf16/fp16 params we own
        self.main_params: list[torch.Tensor | None] = []
        self._hooks = []
        for p, owned in zip(self.model_params, self.owned):
            if p.dtype != torch.float32:
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                self._hooks.append(p.register_post_accumulate_grad_hook(_accumulate_main_grad))
            self.main_params.append((p if p.dtype == torch.float32 else p.detach().clone().float()) if owned else None)
        counted = {id(p) for c in self.chunks for n, p in c.named_parameters() if _counted_in_norm(c, n, p)}
        self.norm_mask = [id(p) in counted for p in self.model_params]

        main_of = {id(p): m for p, m in zip(self.model_params, self.main_params)}
        inner_groups = [{**{k: v for k, v in g.items() if k != "params"},
                         "params": [main_of[id(p)] for p in g["params"] if main_of[id(p)] is not None]}
                        for g in groups]
        device = self.model_params[0].device if self.model_params else torch.device("cpu")
        self.optimizer = make_adam(inner_groups, lr, betas, eps, device)

    # ---------------------------------------------------------------- views
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def grads(self) -> list[torch.Tensor | None]:
        return [grad_of(p) for p in self.model_params]

    def zero_grad(self) -> None:
        for p in self.model_params:
            p.grad = None
            if getattr(p, "main_grad", None) is not None:
                p.main_grad.zero_()

    def _pairs(self):
        """(model param, main param) for the params this rank updates."""
        return [(p, m) for p, m in zip(self.model_params, self.main_params) if m is not None]

    # ---------------------------------------------------------------- step
    @torch.no_grad()
    def step(self) -> tuple[bool, float | None]:
        """Unscale, check inf/nan, clip, update, copy back. Returns (updated, grad_norm or None if skipped)."""
        grads = [g if g is not None else torch.zeros_like(p, dtype=torch.float32)
                 for g, p in zip(self.grads(), self.model_params)]
        if self.scaler.scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / self.scaler.scale)
        found_inf = self._found_inf(grads)
        self.scaler.update(found_inf)
        if found_inf:
            return False, None
        norm = self.grad_norm(grads)
        if self.clip_grad and self.clip_grad > 0:
            coeff = self.clip_grad / (norm + 1e-6)
            if coeff < 1.0:
                torch._foreach_mul_(grads, coeff)
        for main, g in zip(self.main_params, grads):
            if main is not None:
                main.grad = g
        self.optimizer.step()
        for p, main in self._pairs():
            main.grad = None
            if main is not p:
                p.copy_(main)
        if self.zero is not None:
            self.zero.broadcast()
        return True, norm

    def _found_inf(self, grads) -> bool:
        device = grads[0].device if grads else torch.device("cpu")
        flag = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:  # stays on the device: one host sync below
            flag = torch.maximum(flag, (~torch.isfinite(g)).any().float())
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank must skip together
        return bool(flag.item())

    def grad_norm(self, grads=None) -> float:
        grads = self.grads() if grads is None else grads
        counted = [g for g, keep in zip(grads, self.norm_mask) if keep and g is not None]
        device = grads[0].device if grads else torch.device("cpu")
        total = torch.zeros((), dtype=torch.float64, device=device)
        if counted:
            total = torch.stack(torch._foreach_norm(counted)).double().pow(2).sum()
        group = state.get_state().group("mp")
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
        return float(total.sqrt())

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "grad_scaler": self.scaler.state_dict(),
                "fp32_from_fp16_params": [m.detach().clone() for p, m in self._pairs() if m is not p]}

    def load_state_dict(self, sd: dict) -> None:
        halves = [(p, m) for p, m in self._pairs() if m is not p]
        if len(halves) != len(sd.get("fp32_from_fp16_params", [])):
            raise ValueError(f"optimizer state: {len(sd.get('fp32_from_fp16_params', []))} fp32_from_fp16_params "
                             f"saved, the model has {len(halves)} low-precision params on this rank")
        self.optimizer.load_state_dict(sd["optimizer"])
        self.scaler.load_state_dict(sd["grad_scaler"])
        with torch.no_grad():
            for (p, main), saved in zip(halves, sd["fp32_from_fp16_params"]):
                main.copy_(saved)
                p.copy_(saved)
        if self.zero is not None:
            self.zero.broadcast()


def _accumulate_main_grad(p: torch.Tensor) -> None:
    p.main_grad.add_(p.grad)
    p.grad = None

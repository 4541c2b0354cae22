"""`MegatronEngine`: the prepared model.  `model(**batch)` runs a whole train step (train mode) or an
evaluation (eval mode), accelerate's own Megatron-LM convention.

Train mode: the batch (dp rank's share of one global batch) is cut into micro batches of
`micro_batch_size` (batches.py) and goes through forward, backward (pipeline schedule), the
gradient reductions, clipping and the optimizer step (`trainer.train_step`); a
MegatronLMDummyScheduler's schedule advances after a real update (a torch schedule advances
with the script's `scheduler.step()`, as accelerate's AcceleratedScheduler: wrappers.py).
With `Accelerator(gradient_accumulation_steps=k)` and `with accelerator.accumulate(model):` a
call whose `accelerator.sync_gradients` is False only accumulates gradients of loss / k; the call
that syncs reduces them and steps once: k batches, one update, the gradient of the mean of their
losses (accelerate's meaning of accumulation).

Eval mode: forward only.  `loss` is the mean per-token loss of the batch over the data-parallel
group (every rank gets it, in every pipeline stage); with `return_logits` the output also has
`logits` [b, s, vocab] of this rank's batch (logits.py).  A batch without labels gives
transformers' loss=None and the logits.  (Train mode without labels trains on input_ids, as
accelerate's Megatron-LM GPT train step does.)  Outputs are transformers'
`CausalLMOutputWithCrossAttentions`, as accelerate's engine returns for GPT models; in train mode
`logits` is None (they are not kept through the pipeline schedule).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn

from ...errors import ConfigError
from ...parallel import state
from ...training import trainer
from .batches import micro_batches
from .logits import forward_with_logits


def follow_user_lr(optimizer, user_scheduler) -> None:
    """Our groups take the lr (and Adam's betas, which OneCycleLR's cycle_momentum schedules) a torch
    schedule gave the user's groups they came from.  (A schedule built on the prepared optimizer
    already set ours: its param_groups are ours.)"""
    source = user_scheduler.optimizer.param_groups
    if source is optimizer.param_groups:
        return
    for group in optimizer.param_groups:
        user = source[group.get("user_group", 0)]
        group["lr"] = user["lr"]
        if "betas" in user and "betas" in group:
            group["betas"] = tuple(user["betas"])


def _output(loss: torch.Tensor, logits: torch.Tensor | None = None):
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions
    return CausalLMOutputWithCrossAttentions(loss=loss, logits=logits)


def _generators() -> dict:
    """The default generators a step draws from: CPU's and the current CUDA device's."""
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_generators(states: dict) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


class EngineRNG:
    """The engine's own default-generator stream, apart from the user's.

    `trainer.build_model` seeds the default generators alike on the tensor-parallel ranks of a
    replica (Megatron's seed + 100 * pp rank) and draws from them; dropout in the replicated
    regions of a step draws from them too.  Plain accelerate's prepare(model) draws nothing, so
    the build and every step run with this stream swapped in, and the user's generators (set_seed,
    the script's own draws) are left exactly as plain accelerate leaves them -- while the tensor-
    parallel ranks still agree on their replicated dropout masks whatever the user seeded.
    `build` runs `fn` with the default generators as it leaves them for the engine."""

    def __init__(self, states: dict) -> None:
        self.states = states

    @classmethod
    def build(cls, fn):
        user = _generators()
        try:
            result = fn()
            own = cls(_generators())
        finally:
            _set_generators(user)
        return result, own

    @contextlib.contextmanager
    def active(self):
        user = _generators()
        _set_generators(self.states)
        try:
            yield
        finally:
            self.states = _generators()
            _set_generators(user)


class MegatronEngine(nn.Module):
    """This rank's model chunks + optimizer + schedule, behind a transformers-like forward."""

    def __init__(self, chunks: list[nn.Module], cfg: trainer.TrainingConfig, hf_config, accelerator,
                 rng: EngineRNG | None = None):
        super().__init__()
        self.rng = rng or EngineRNG(_generators())  # the stream the steps draw from (not the user's)
        self.chunks = nn.ModuleList(chunks)
        self.cfg, self.hf_config = cfg, hf_config
        self._accelerator = [accelerator]  # a list: not a submodule, not in state_dict
        self.optimizer = None          # our MixedPrecisionOptimizer, set by prepare
        self.scheduler = None          # our LRScheduler (from MegatronLMDummyScheduler), or None
        self.user_scheduler = None     # a torch scheduler whose lr we follow (stepped by wrappers.py), or None
        self.iteration = 0             # optimizer updates taken
        self.consumed_train_samples = 0
        self.skipped_iter = False
        self.grad_norm = None          # total grad norm (before clipping) of the last update, or None
        self._accumulated = 0          # batches back-propagated since the last update

    @property
    def config(self):
        return self.hf_config

    @property
    def accelerator(self):
        return self._accelerator[0]

    @property
    def accumulated(self) -> int:
        """Batches back-propagated since the last update (0 right after an update)."""
        return self._accumulated

    # ------------------------------------------------------------------ batching
    @property
    def num_micro_batches(self) -> int:
        return int(self.accelerator.state.megatron_lm_plugin.num_micro_batches or 1)

    def _micro_batch_size(self, batch_size: int) -> int:
        size = getattr(self.accelerator.state.megatron_lm_plugin, "micro_batch_size", None)
        return int(size) if size else max(math.ceil(batch_size / self.num_micro_batches), 1)

    def _split(self, batch: dict, whole: bool = False) -> list[dict]:
        """Micro batches on the model's device (`whole`: the batch as one micro batch)."""
        device = next(self.chunks[0].parameters()).device
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        size = batch["input_ids"].shape[0]
        # sequence parallelism cuts the sequence into tp slices: pad any length to a multiple (batches.py)
        seq_multiple = state.get_state().tp if self.cfg.sequence_parallel else 1
        if whole:
            return micro_batches(batch, size, seq_multiple=seq_multiple)
        interleaved = len(self.chunks) > 1  # the interleaved schedule wants a multiple of pp micro batches
        return micro_batches(batch, self._micro_batch_size(size), state.get_state().pp if interleaved else 1,
                             seq_multiple=seq_multiple)

    # ------------------------------------------------------------------ forward
    def forward(self, **batch):
        if "input_ids" not in batch or batch["input_ids"] is None:
            raise ConfigError("model(**batch) (Megatron-LM engine): expected an 'input_ids' tensor")
        # transformers' output switches, as a training script passes them (`model(**batch, use_cache=False)`):
        # no cache is kept in any case; attentions / hidden states are not returned by the engine
        batch.pop("use_cache", None)
        return_dict = batch.pop("return_dict", None)
        for flag in ("output_attentions", "output_hidden_states"):
            if batch.pop(flag, None):
                raise ConfigError(f"model(**batch, {flag}=True) (Megatron-LM engine): not available; the engine returns "
                                  f"the loss (and logits with MegatronLMPlugin(return_logits=True) in eval mode)")
        # the engine runs its own mixed precision: a script's `with accelerator.autocast():` around the call
        # (plain accelerate's model is autocast already, so there it changes nothing) changes nothing here either
        device_type = next(self.chunks[0].parameters()).device.type
        with self.rng.active(), torch.autocast(device_type=device_type, enabled=False):
            out = self._train(batch) if self.training else self._evaluate(batch)
        return out if return_dict is None or return_dict else out.to_tuple()  # transformers' return_dict=False

    def _train(self, batch: dict):
        if self.optimizer is None:
            raise ConfigError("model(**batch) in train mode: no optimizer was prepared; call "
                              "accelerator.prepare(optimizer) (any order, any call) before training")
        micro = self._split(batch)
        acc = self.accelerator
        steps = max(int(acc.gradient_accumulation_steps), 1)
        sync = steps == 1 or acc.sync_gradients
        stats = trainer.train_step(list(self.chunks), self.optimizer, self.scheduler, micro,
                                   accumulate=not sync, fresh=self._accumulated == 0, loss_weight=1.0 / steps)
        self._accumulated = 0 if sync else self._accumulated + 1
        self.consumed_train_samples += batch["input_ids"].shape[0] * state.get_state().dp
        if sync:
            self.iteration += 1
            self.skipped_iter = stats["skipped"]
            self.grad_norm = float("inf") if stats["skipped"] else stats["grad_norm"]
        return _output(torch.tensor(stats["loss"], device=micro[0]["targets"].device))

    @torch.no_grad()
    def _evaluate(self, batch: dict):
        plugin = self.accelerator.state.megatron_lm_plugin
        # no labels: transformers' loss=None with the logits (the loss of the tokens themselves is not asked for)
        unlabelled = batch.get("labels") is None
        if unlabelled or getattr(plugin, "return_logits", False):
            (whole,) = self._split(batch, whole=True)
            for chunk in self.chunks:
                chunk.eval()
            loss_sum, tokens, logits = forward_with_logits(list(self.chunks), whole)
            totals = torch.stack([loss_sum, tokens]).double()
            group = state.get_state().group("dp")
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(totals, group=group)
            loss = None if unlabelled else (totals[0] / totals[1].clamp(min=1)).float()
            return _output(loss, logits[:, :batch["input_ids"].shape[1]])  # without sequence padding
        micro = self._split(batch)
        loss = trainer.evaluate(list(self.chunks), micro)
        return _output(torch.tensor(loss, device=micro[0]["targets"].device))

    @contextlib.contextmanager
    def no_sync(self):
        """DDP's no_sync, which accelerate's `accumulate` enters for a batch that does not sync: such a
        call already only accumulates.  A script's own accumulation (`with accelerator.no_sync(model):`
        around some batches) cannot work: each model(**batch) is a whole step and the loss the script
        divides is not the one back-propagated -- refused rather than k updates instead of one."""
        if self.accelerator.sync_gradients:
            raise ConfigError("accelerator.no_sync(model) under Megatron-LM: each model(**batch) is a whole train step; "
                              "accumulate with Accelerator(gradient_accumulation_steps=k) and "
                              "`with accelerator.accumulate(model):` instead")
        yield

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """nn.Module's, then the optimizer's fp32 main weights (bf16 / fp16) are copied from the loaded
        weights (megatron-core's `reload_model_params`): the next step updates what was loaded, as in
        plain torch, instead of writing the stale main weights back over it."""
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        if self.optimizer is not None:
            self.optimizer.reload_model_params()
        return result

    def save_checkpoint(self, output_dir) -> None:
        """accelerate's engine API: `accelerator.save_state(output_dir)` is the way to call it."""
        self.accelerator.save_state(output_dir)

    def load_checkpoint(self, input_dir) -> None:
        self.accelerator.load_state(input_dir)

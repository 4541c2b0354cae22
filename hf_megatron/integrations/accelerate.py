"""`accelerate launch --config_file megatron.yaml train.py` without NVIDIA's `megatron` package.

In train.py, import the Accelerator from here instead of from accelerate:

    from hf_megatron.integrations.accelerate import Accelerator
    accelerator = Accelerator()
    model, optimizer, loader, scheduler = accelerator.prepare(hf_model, optimizer, loader, scheduler)
    for batch in loader:
        loss = model(**batch).loss        # one whole Megatron step: micro batches, pipeline, optimizer
        accelerator.backward(loss)        # no-op (done inside the step), kept so scripts stay unchanged
        optimizer.step(); scheduler.step(); optimizer.zero_grad()   # no-ops likewise

This is accelerate's own Megatron-LM convention (its MegatronEngine runs the train step inside
forward).  The layout comes from the config file's `megatron_lm_config` (accelerate turns it into
MEGATRON_LM_* variables and its MegatronLMPlugin reads them): tp_degree, pp_degree,
num_micro_batches, sequence_parallelism, gradient_clipping, recompute_activations,
use_distributed_optimizer, and `other_megatron_args` for the rest (e.g.
virtual_pipeline_model_parallel_size, recompute_granularity, seed).  Mixed precision is the
config's `mixed_precision` (bf16 / fp16 / no).  Without a Megatron config the class is plain
`accelerate.Accelerator`.

What `prepare` does with each object:
* a transformers causal LM -> this rank's Megatron model chunks, pretrained weights kept, wrapped
  in `MegatronEngine`;
* a torch optimizer -> its hyper-parameters (lr, betas, eps, weight_decay) are reused for our
  mixed-precision (optionally ZeRO-1) AdamW over the chunks;
* a torch LR scheduler -> kept on the user's optimizer and stepped once per real update; its lr
  is copied into ours, so any torch / transformers schedule works;
* a DataLoader -> sharded over the *data-parallel* ranks only (TP and PP ranks of one model
  replica read the same batches); each batch is one dp rank's share of the global batch and is
  split into `num_micro_batches` micro batches.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
import warnings
from dataclasses import dataclass
from typing import Any

import accelerate
import torch
from torch import nn

from ..errors import ConfigError
from ..model.gpt import shift_labels
from ..parallel import state
from ..training import trainer

_ENV_FLAG = "ACCELERATE_USE_MEGATRON_LM"


def megatron_requested() -> bool:
    return os.environ.get(_ENV_FLAG, "false").lower() == "true"


@contextlib.contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def training_config_from_plugin(plugin, mixed_precision: str) -> trainer.TrainingConfig:
    """accelerate's MegatronLMPlugin (+ mixed precision) -> our TrainingConfig (Megatron names)."""
    other = dict(plugin.other_megatron_args or {})
    recompute = other.pop("recompute_granularity", None)
    if recompute is None and plugin.recompute_activations:
        recompute = "selective"  # accelerate's recompute_activations means Megatron's selective
    fields = dict(
        tensor_model_parallel_size=int(plugin.tp_degree or 1),
        pipeline_model_parallel_size=int(plugin.pp_degree or 1),
        sequence_parallel=bool(plugin.sequence_parallelism),
        use_distributed_optimizer=bool(plugin.use_distributed_optimizer),
        clip_grad=float(plugin.gradient_clipping if plugin.gradient_clipping is not None else 1.0),
        recompute_granularity=recompute,
        bf16=mixed_precision == "bf16",
        fp16=mixed_precision == "fp16",
    )
    fields.update(other)
    try:
        return trainer.TrainingConfig.from_dict(fields)
    except ConfigError as exc:
        raise ConfigError(f"megatron_lm_config / other_megatron_args: {exc}") from None


@dataclass
class StepOutput:
    loss: torch.Tensor
    grad_norm: float | None = None
    lr: float | None = None
    skipped: bool = False


class MegatronEngine(nn.Module):
    """The prepared model: `forward(**batch)` runs one train step (train mode) or an evaluation."""

    def __init__(self, chunks: list[nn.Module], cfg: trainer.TrainingConfig, num_micro_batches: int):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.cfg, self.num_micro_batches = cfg, num_micro_batches
        self.optimizer = None  # set by Accelerator.prepare
        self.user_scheduler = None
        self.iteration = 0

    @property
    def config(self):
        return self.chunks[0].config

    def _micro_batches(self, batch: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
        if "input_ids" not in batch:
            raise ValueError("batch: expected an 'input_ids' tensor")
        batch = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        if "labels" not in batch:
            labels = batch["input_ids"].clone()
            if "attention_mask" in batch:
                labels = labels.masked_fill(batch["attention_mask"] == 0, -100)
            batch["labels"] = labels
        batch["targets"] = shift_labels(batch.pop("labels"))  # transformers' labels -> aligned targets, once
        size = batch["input_ids"].shape[0]
        if size % self.num_micro_batches:
            raise ValueError(f"batch of {size} samples is not divisible by num_micro_batches={self.num_micro_batches}")
        keep = ("input_ids", "targets", "attention_mask", "position_ids")
        parts = {k: v.chunk(self.num_micro_batches) for k, v in batch.items() if k in keep}
        return [{k: v[i] for k, v in parts.items()} for i in range(self.num_micro_batches)]

    def forward(self, **batch) -> StepOutput:
        micro_batches = self._micro_batches(batch)
        if not self.training:
            return StepOutput(loss=torch.tensor(trainer.evaluate(list(self.chunks), micro_batches)))
        if self.optimizer is None:
            raise RuntimeError("MegatronEngine: pass the optimizer to accelerator.prepare together with the model")
        stats = trainer.train_step(list(self.chunks), self.optimizer, None, micro_batches)
        self.iteration += 1
        if not stats["skipped"] and self.user_scheduler is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the user's optimizer is never stepped: by design
                self.user_scheduler.step()
            new_lr = self.user_scheduler.get_last_lr()[0]
            for group in self.optimizer.param_groups:
                group["lr"] = new_lr
        return StepOutput(loss=torch.tensor(stats["loss"]), grad_norm=stats["grad_norm"], lr=stats["lr"],
                          skipped=stats["skipped"])


class _StepDone:
    """Optimizer / scheduler handed back to the user: stepping is done inside MegatronEngine."""

    def __init__(self, wrapped):
        self._wrapped = wrapped

    def step(self, *args, **kwargs):
        return None

    def zero_grad(self, *args, **kwargs):
        return None

    def __getattr__(self, name):
        return getattr(self._wrapped, name)


class Accelerator(accelerate.Accelerator):
    def __init__(self, *args, **kwargs):
        self.megatron = megatron_requested()
        if not self.megatron:
            super().__init__(*args, **kwargs)
            return
        from accelerate.utils import MegatronLMPlugin
        plugin = kwargs.pop("megatron_lm_plugin", None) or MegatronLMPlugin()
        if not torch.cuda.is_available():
            kwargs.setdefault("cpu", True)  # several CPU processes: accelerate's MULTI_CPU (gloo)
        # accelerate would insist on NVIDIA's megatron package: initialise as plain multi-process
        with _env(_ENV_FLAG, "false"):
            super().__init__(*args, **kwargs)
        self.megatron_plugin = plugin
        self.megatron_config = training_config_from_plugin(plugin, self.mixed_precision)
        self.megatron_grid = trainer.setup_parallel(self.megatron_config)
        self._engine: MegatronEngine | None = None

    # ------------------------------------------------------------------ prepare
    def prepare(self, *objects, device_placement=None):
        if not self.megatron:
            return super().prepare(*objects, device_placement=device_placement)
        results = list(objects)
        model_index = [i for i, o in enumerate(objects) if isinstance(o, nn.Module)]
        if len(model_index) != 1:
            raise ValueError("accelerator.prepare (Megatron): pass exactly one transformers model")
        results[model_index[0]] = self._prepare_model(objects[model_index[0]])
        for i, obj in enumerate(objects):
            if isinstance(obj, torch.optim.Optimizer):
                results[i] = self._prepare_optimizer(obj)
            elif isinstance(obj, torch.utils.data.DataLoader):
                results[i] = self._prepare_loader(obj)
        for i, obj in enumerate(objects):
            if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
                self._engine.user_scheduler = obj
                results[i] = _StepDone(obj)
        if self._engine.optimizer is None:
            raise ValueError("accelerator.prepare (Megatron): pass the optimizer together with the model")
        return results[0] if len(results) == 1 else tuple(results)

    def _prepare_model(self, model: nn.Module) -> MegatronEngine:
        cfg = self.megatron_config
        chunks = trainer.build_model(model, cfg, device=self.device)
        num_micro = int(self.megatron_plugin.num_micro_batches or 1)
        self._engine = MegatronEngine(chunks, cfg, num_micro)
        return self._engine

    def _prepare_optimizer(self, optimizer: torch.optim.Optimizer):
        group = optimizer.param_groups[0]
        betas = group.get("betas", (0.9, 0.999))
        cfg = self.megatron_config
        cfg.lr, cfg.weight_decay, cfg.adam_eps = group["lr"], group.get("weight_decay", 0.0), group.get("eps", 1e-8)
        cfg.adam_beta1, cfg.adam_beta2 = betas
        self._engine.optimizer = trainer.build_optimizer(list(self._engine.chunks), cfg)
        return _StepDone(self._engine.optimizer)

    def _prepare_loader(self, loader: torch.utils.data.DataLoader):
        from accelerate.data_loader import prepare_data_loader
        grid = state.get_state()
        return prepare_data_loader(loader, device=self.device, num_processes=grid.dp,
                                   process_index=grid.rank_in("dp"), put_on_device=True)

    # ------------------------------------------------------------------ no-ops / helpers
    def backward(self, loss, **kwargs):
        if not self.megatron:
            return super().backward(loss, **kwargs)
        return None  # the engine has already run backward (and the optimizer step)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        if not self.megatron:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        return None  # clipping is the engine's (gradient_clipping in the config)

    def save_megatron_checkpoint(self, save_dir: str | os.PathLike, iteration: int | None = None) -> None:
        """Megatron-LM layout checkpoint of the prepared model and optimizer (every rank calls this)."""
        from ..training.checkpoint import save_checkpoint
        engine = self._engine
        save_checkpoint(save_dir, engine.iteration if iteration is None else iteration, list(engine.chunks),
                        optimizer=engine.optimizer)

    def save_pretrained(self, out_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike | None = None,
                        dtype: str | None = None) -> None:
        """The prepared model as a Hugging Face folder (`AutoModelForCausalLM.from_pretrained` loads
        it): a Megatron checkpoint of every rank's shard, merged by the converter on rank 0.
        Every rank calls this."""
        import shutil

        import torch.distributed as dist

        from ..conversion.convert import megatron_to_hf
        out_dir = Path(out_dir)
        scratch = out_dir.with_name(f".{out_dir.name}.megatron")
        self.save_megatron_checkpoint(scratch)
        if self.is_main_process:
            try:
                megatron_to_hf(scratch, out_dir, dtype=dtype, tokenizer=tokenizer_dir)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        if dist.is_initialized():
            dist.barrier()

"""The training configuration, written once: `TrainingConfig` (how to train) and `RunConfig` (what
to train on, where to write).

Field names are Megatron-LM's argument names; `hf-megatron train`'s flags are generated from
these fields (`lr_warmup_iters` -> `--lr-warmup-iters`, see commands/flags.py), so each field
carries its help text, flag group and, where it matters, its choices, bounds and CLI
required-ness in `metadata`.  All validation happens here, in `__post_init__`: a bad value raises
`ConfigError` with one line naming the field, its flag and what was expected, whether it came
from the command line, from Python or from accelerate's `other_megatron_args`.
"""
from __future__ import annotations

import dataclasses
import difflib
import operator
from dataclasses import MISSING, dataclass, field
from typing import Any

import torch

from ..errors import ConfigError
from ..parallel import state

DECAY_STYLES = ("constant", "linear", "cosine")
RECOMPUTE_GRANULARITIES = ("full", "selective")
BOUNDS = (("at_least", ">=", operator.ge), ("above", ">", operator.gt), ("below", "<", operator.lt))


def option(default: Any = MISSING, *, help: str, group: str, choices: tuple | None = None,
           at_least: float | None = None, above: float | None = None, below: float | None = None,
           cli_required: bool = False):
    """A dataclass field with what the CLI and the checks need to know about it.

    `at_least` / `above` / `below`: bounds (>=, >, <) checked by `check_fields`; None values are
    not checked (they mean "unset").  `cli_required`: the flag must be given on the command line
    even though Python callers get the default."""
    metadata = {"help": help, "group": group, "choices": choices, "at_least": at_least, "above": above,
                "below": below, "cli_required": cli_required}
    return field(default=default, metadata=metadata)


def flag_of(name: str) -> str:
    """Megatron-LM's flag for a field: `lr_warmup_iters` -> `--lr-warmup-iters`."""
    return "--" + name.replace("_", "-")


def _fail(config, name: str, expected: str, value: Any) -> None:
    raise ConfigError(f"{type(config).__name__}.{name} ({flag_of(name)}): expected {expected}, got {value!r}")


def check_fields(config) -> None:
    """Check every field against its metadata's choices and bounds (one-line ConfigError)."""
    for f in dataclasses.fields(config):
        value, meta = getattr(config, f.name), f.metadata
        if value is None and "None" not in str(f.type):  # annotations are strings here
            _fail(config, f.name, "a value (this field cannot be unset)", value)
        if f.type == "bool" and not isinstance(value, bool):
            _fail(config, f.name, "True or False", value)
        if value is None or isinstance(value, bool):
            continue
        if meta.get("choices") and value not in meta["choices"]:
            _fail(config, f.name, f"one of {', '.join(meta['choices'])}", value)
        bounds = [(meta[key], symbol, test) for key, symbol, test in BOUNDS if meta.get(key) is not None]
        try:
            ok = all(test(value, bound) for bound, _, test in bounds)
        except TypeError:  # e.g. a string from a YAML file
            ok = False
        if not ok:
            _fail(config, f.name, "a number " + " and ".join(f"{symbol} {bound}" for bound, symbol, _ in bounds), value)


@dataclass
class TrainingConfig:
    """Training hyper-parameters, named as Megatron-LM's command-line arguments."""

    micro_batch_size: int = option(1, group="training", at_least=1, help="samples per micro batch per dp rank")
    global_batch_size: int | None = option(
        None, group="training", at_least=1,
        help="samples per optimizer step over all dp ranks, a multiple of micro batch x dp "
             "(default: micro batch x dp, one micro batch per step)")
    train_iters: int = option(1, group="training", at_least=1, cli_required=True, help="optimizer steps to run")
    lr: float = option(1e-4, group="training", at_least=0.0, help="peak learning rate")
    min_lr: float = option(0.0, group="training", at_least=0.0, help="learning rate floor of the decay")
    lr_warmup_iters: int = option(0, group="training", at_least=0, help="linear warmup from 0 over this many steps")
    lr_decay_iters: int | None = option(None, group="training", at_least=1,
                                        help="decay horizon in steps (default: --train-iters)")
    lr_decay_style: str = option("linear", group="training", choices=DECAY_STYLES, help="learning-rate decay")
    weight_decay: float = option(0.01, group="training", at_least=0.0, help="AdamW weight decay (not on biases, norms)")
    adam_beta1: float = option(0.9, group="training", at_least=0.0, below=1.0, help="AdamW beta1")
    adam_beta2: float = option(0.999, group="training", at_least=0.0, below=1.0, help="AdamW beta2")
    adam_eps: float = option(1e-8, group="training", above=0.0, help="AdamW epsilon")
    clip_grad: float = option(1.0, group="training", at_least=0.0, help="global gradient-norm clip; 0 disables it")
    bf16: bool = option(False, group="mixed precision", help="bf16 weights and compute, fp32 main weights")
    fp16: bool = option(False, group="mixed precision", help="fp16 weights and compute, fp32 main weights, loss scaling")
    loss_scale: float | None = option(None, group="mixed precision", above=0.0,
                                      help="fp16: static loss scale (default: dynamic loss scaling)")
    initial_loss_scale: float = option(2.0 ** 32, group="mixed precision", above=0.0,
                                       help="fp16: initial dynamic loss scale")
    min_loss_scale: float = option(1.0, group="mixed precision", above=0.0, help="fp16: minimum dynamic loss scale")
    loss_scale_window: int = option(1000, group="mixed precision", at_least=1,
                                    help="fp16: good steps before the dynamic scale grows")
    hysteresis: int = option(2, group="mixed precision", at_least=1,
                             help="fp16: overflows tolerated before the dynamic scale shrinks")
    tensor_model_parallel_size: int = option(1, group="parallelism", at_least=1, help="tensor-parallel size")
    pipeline_model_parallel_size: int = option(1, group="parallelism", at_least=1, help="pipeline-parallel size")
    virtual_pipeline_model_parallel_size: int | None = option(
        None, group="parallelism", at_least=1, help="model chunks per pipeline stage (interleaved schedule)")
    sequence_parallel: bool = option(False, group="parallelism",
                                     help="shard norms and dropout over the sequence across TP ranks")
    use_distributed_optimizer: bool = option(
        False, group="parallelism",
        help="Megatron's distributed optimizer: fp32 main weights and Adam state sharded over dp ranks by "
             "contiguous ranges of the grad buffer (grads reduce-scattered, params all-gathered)")
    overlap_grad_reduce: bool = option(False, group="parallelism",
                                       help="launch each grad bucket's dp reduction during the last micro batch's "
                                            "backward")
    overlap_param_gather: bool = option(False, group="parallelism",
                                        help="distributed optimizer: overlap each bucket's param all-gather with the "
                                             "next forward")
    ddp_bucket_size: int | None = option(None, group="parallelism", at_least=1,
                                         help="elements per dp-reduction bucket (default: max(40M, 1M x dp))")
    recompute_granularity: str | None = option(None, group="training", choices=RECOMPUTE_GRANULARITIES,
                                               help="activation recomputation (default: none)")
    seed: int = option(1234, group="training", at_least=0, help="seed of weights init, dropout and data shuffling")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.bf16 and self.fp16:
            raise ConfigError("TrainingConfig: bf16 and fp16 are exclusive (--bf16 / --fp16: give at most one)")
        if self.global_batch_size is not None and self.global_batch_size % self.micro_batch_size:
            raise ConfigError(f"TrainingConfig.global_batch_size (--global-batch-size): expected a multiple of "
                              f"--micro-batch-size {self.micro_batch_size}, got {self.global_batch_size}")
        horizon = self.lr_decay_iters or self.train_iters
        if self.lr_decay_style != "constant" and horizon <= self.lr_warmup_iters:
            raise ConfigError(f"TrainingConfig.lr_warmup_iters (--lr-warmup-iters): expected fewer than the decay "
                              f"horizon {horizon} (--lr-decay-iters, else --train-iters), got {self.lr_warmup_iters}")
        if self.min_lr > self.lr:
            raise ConfigError(f"TrainingConfig.min_lr (--min-lr): expected at most --lr {self.lr}, got {self.min_lr}")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ConfigError("TrainingConfig.overlap_param_gather (--overlap-param-gather): expected "
                              "--use-distributed-optimizer as well (only its params are gathered)")
        if (self.virtual_pipeline_model_parallel_size or 1) > 1 and self.pipeline_model_parallel_size == 1:
            raise ConfigError("TrainingConfig.virtual_pipeline_model_parallel_size (--virtual-pipeline-model-"
                              "parallel-size): expected --pipeline-model-parallel-size > 1, got "
                              f"{self.virtual_pipeline_model_parallel_size} with pipeline size 1")

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32

    def num_micro_batches(self, dp: int | None = None) -> int:
        dp = state.get_state().dp if dp is None else dp
        gbs = self.global_batch_size or self.micro_batch_size * dp
        if gbs % (self.micro_batch_size * dp):
            raise ConfigError(f"TrainingConfig.global_batch_size={gbs} (--global-batch-size) is not divisible by "
                              f"micro_batch_size ({self.micro_batch_size}) x data-parallel size ({dp})")
        return gbs // (self.micro_batch_size * dp)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainingConfig":
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            hints = {u: difflib.get_close_matches(u, names, n=1) for u in unknown}
            hint = "; ".join(f"{u!r}: did you mean {m[0]!r}?" for u, m in hints.items() if m)
            raise ConfigError(f"TrainingConfig: unknown field(s) {unknown} (expected Megatron-LM argument names "
                              f"such as micro_batch_size, lr, clip_grad{'; ' + hint if hint else ''})")
        return cls(**data)


@dataclass(kw_only=True)
class RunConfig:
    """What to train on and where to write: everything that is not a TrainingConfig field."""

    hf_model: str | None = option(None, group="model", help="HF folder or Hub id: pretrained weights and config (this or --hf-config)")
    hf_config: str | None = option(None, group="model",
                                   help="HF config.json (file or folder): fresh Megatron-style init")
    data_path: list[str] = option(group="data", help="prefix, or 'w1 prefix1 w2 prefix2 ...'")
    split: str = option("969,30,1", group="data", help="train,valid,test shares of the documents")
    seq_length: int = option(1024, group="data", at_least=2, help="tokens per sample")
    data_cache_path: str | None = option(None, group="data",
                                         help="where the index .npy files go (default: <data dir>/cache)")
    save: str | None = option(None, group="checkpointing and logging", help="checkpoint folder to write")
    save_interval: int | None = option(None, group="checkpointing and logging", at_least=1,
                                       help="save every N steps (default: only at the end)")
    load: str | None = option(None, group="checkpointing and logging",
                              help="checkpoint folder to resume from (started fresh when it holds none)")
    log_interval: int = option(10, group="checkpointing and logging", at_least=1, help="print every N steps")
    eval_interval: int | None = option(None, group="checkpointing and logging", at_least=1,
                                       help="evaluate on the valid split every N steps (default: never)")
    eval_iters: int = option(10, group="checkpointing and logging", at_least=1,
                             help="global batches per evaluation")
    tensorboard_dir: str | None = option(None, group="checkpointing and logging", help="TensorBoard log folder")

    def __post_init__(self) -> None:
        check_fields(self)
        if bool(self.hf_model) == bool(self.hf_config):
            raise ConfigError("RunConfig: give exactly one of --hf-model (pretrained weights) or --hf-config "
                              f"(fresh init from a config.json), got hf_model={self.hf_model!r}, "
                              f"hf_config={self.hf_config!r}")
        from ..data.builder import parse_blend, split_bookends
        # a bad --data-path blend or --split fails here, before any model is built
        _, weights = parse_blend(self.data_path)
        if weights is not None and not all(w > 0 for w in weights):
            _fail(self, "data_path", "positive blend weights in 'w1 prefix1 w2 prefix2 ...'", self.data_path)
        split_bookends(self.split)

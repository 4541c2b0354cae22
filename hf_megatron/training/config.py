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
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ..data.tokenizers import TOKENIZER_TYPES
from ..errors import ConfigError
from .config_fields import _fail, check_fields, flag_of, option  # noqa: F401  (re-exported)
from .model_flags import MEGATRON_DROPOUT, ModelFlags
from ..parallel import state
from ..parallel.compile import SCOPES as COMPILE_SCOPES
from ..parallel.float8 import FP8_FORMATS, FP8_RECIPES, check_fp8_choice

DECAY_STYLES = ("constant", "linear", "cosine")
CKPT_FORMATS = ("torch", "torch_dist")  # Megatron-LM's --ckpt-format values train writes
MOMENT_DTYPES = ("fp32", "bf16")  # Megatron-LM's --exp-avg-dtype / --exp-avg-sq-dtype choices we offer
RECOMPUTE_GRANULARITIES = ("full", "selective")
MEGATRON_DESTS = {"fp8": "fp8_format"}  # Megatron-LM's argparse dest -> our field (its flag's name)


@dataclass
class TrainingConfig:
    """Training hyper-parameters, named as Megatron-LM's command-line arguments."""

    micro_batch_size: int = option(1, group="training", at_least=1, help="samples per micro batch per dp rank")
    global_batch_size: int | None = option(
        None, group="training", at_least=1,
        help="samples per optimizer step over all dp ranks, a multiple of micro batch x dp "
             "(default: micro batch x dp, one micro batch per step)")
    train_iters: int | None = option(
        None, group="training", at_least=1,
        help="optimizer steps to run, counted over all runs of a resumed job (this or --train-samples)")
    train_samples: int | None = option(
        None, group="training", at_least=1,
        help="samples to train on instead of --train-iters: steps = train_samples // global batch size")
    lr: float = option(1e-4, group="training", at_least=0.0, help="peak learning rate")
    min_lr: float = option(0.0, group="training", at_least=0.0, help="learning rate floor of the decay")
    lr_warmup_iters: int = option(0, group="training", at_least=0, help="linear warmup from 0 over this many steps")
    lr_warmup_fraction: float | None = option(
        None, group="training", at_least=0.0, below=1.0,
        help="warmup over this fraction of the decay horizon instead of --lr-warmup-iters")
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
                                      help="static loss scale: fp16 (default: dynamic loss scaling), bf16 and the "
                                           "distributed optimizer (megatron-core's constant scaler: an overflowing "
                                           "step is skipped); fp32 without the distributed optimizer has none")
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
                                               help="activation recomputation: selective = core attention, "
                                                    "full = every transformer layer from its input (Megatron-LM's "
                                                    "full with --recompute-method uniform --recompute-num-layers 1, "
                                                    "flags not offered) (default: none)")
    torch_compile: bool | None = option(
        None, group="speed", off_switch="--no-torch-compile",
        help="torch.compile each transformer layer and the loss (regional compile); default: on when the model "
             "runs on a CUDA GPU (faster and smaller there: bench/RESULTS.md), off on CPU")
    torch_compile_scope: str = option(
        "layer", group="speed", choices=COMPILE_SCOPES,
        help="the compiled regions (compile: on CUDA by default): layer = each transformer layer its own region "
             "(one graph reused by every layer: short compile); decoder = this stage's whole decoder stack as one "
             "region (asks for compile; longer compile, one compiled call per pass instead of one per layer, fusion "
             "across layers; not with --recompute-granularity)")
    activation_memory_budget: float | None = option(
        None, group="speed", above=0.0, below=1.0,
        help="compiled regions (asks for compile) save at most about this fraction of the activations "
             "torch's partitioner keeps by default and recompute the cheapest rest in backward (torch's "
             "activation_memory_budget, torchtitan's memory_budget mode): less memory for some recompute "
             "(default: off)")
    cross_entropy_loss_fusion: bool = option(
        False, group="speed", help="output layer + cross entropy in chunks, no whole [tokens, vocab] logits: less "
                                   "memory, a few %% slower (bench/RESULTS.md)")
    fp8_format: str | None = option(
        None, group="speed", choices=FP8_FORMATS,
        help="float8 training of the layers' linears through torchao (needs --bf16, a CUDA GPU of compute "
             "capability 8.9+ and torchao; tp 1): hybrid = e4m3 activations and weights, e5m2 gradients; "
             "e4m3 = e4m3 everywhere (default: off)")
    fp8_recipe: str = option(
        "tensorwise", group="speed", choices=FP8_RECIPES,
        help="with --fp8-format: tensorwise = one dynamic scale per tensor; rowwise = one per row (e4m3 only); "
             "rowwise_with_gw_hp = rowwise with the weight-gradient GEMM in bf16 (torchao's recipe, e4m3 only); "
             "Megatron-LM's delayed / mxfp8 / blockwise are Transformer Engine recipes torchao does not have")
    first_last_layers_bf16: bool = option(
        False, group="speed", help="with --fp8-format: keep the first and last transformer layers' linears in bf16 "
                                   "(how many: --num-layers-at-start-in-bf16 / --num-layers-at-end-in-bf16)")
    num_layers_at_start_in_bf16: int = option(1, group="speed", at_least=0,
                                              help="with --first-last-layers-bf16: layers kept bf16 at the start")
    num_layers_at_end_in_bf16: int = option(1, group="speed", at_least=0,
                                            help="with --first-last-layers-bf16: layers kept bf16 at the end")
    gradient_accumulation_fusion: bool = option(
        False, group="speed", off_switch="--no-gradient-accumulation-fusion", help="accumulate each transformer-layer linear's weight gradient straight into its fp32 "
                                   "main grad inside the weight-gradient GEMM (parallel/wgrad.py); Megatron-LM has "
                                   "it on unless --no-gradient-accumulation-fusion, here off until measured")
    use_precision_aware_optimizer: bool = option(
        False, group="speed", help="AdamW steps in hf_megatron's csrc kernel (training/fused_adamw.py) by default on "
                                   "CUDA anyway: it reads bf16 grads as they are and writes the bf16 weights in the "
                                   "same pass, fp32 main weights and moments, torch's fused AdamW's arithmetic; "
                                   "this flag only warns when the kernel cannot run (no CUDA, HF_MEGATRON_KERNELS=0, "
                                   "a failed build), where torch's AdamW steps. Megatron-LM's flag runs Transformer "
                                   "Engine's FusedAdam; of its dtype flags --exp-avg-dtype / --exp-avg-sq-dtype bf16 are "
                                   "offered, --main-grads-dtype / --main-params-dtype are not")
    exp_avg_dtype: str = option(
        "fp32", group="speed", choices=MOMENT_DTYPES,
        help="with --use-precision-aware-optimizer: the dtype AdamW's first moment is stored in between steps "
             "(computed in fp32 and rounded to nearest; checkpoints hold it in fp32, as Megatron-LM's do); "
             "Megatron-LM's fp16 / fp8 need Transformer Engine's scaled states and are not offered")
    exp_avg_sq_dtype: str = option(
        "fp32", group="speed", choices=MOMENT_DTYPES,
        help="with --use-precision-aware-optimizer: the same for the second moment")
    defer_step_stats: bool = option(
        False, group="speed", help="hf-megatron train reads each step's loss and grad norm after the next step's "
                                   "forward and backward are queued, so the GPU does not wait for the host between "
                                   "steps (training/deferred.py); the same numbers, logs, evaluations and "
                                   "checkpoints; off by default: +0.5-2% on one H200, within the spread between "
                                   "runs (README, Speed options)")
    seed: int = option(1234, group="training", at_least=0, help="seed of weights init, dropout and data shuffling")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.fp8_format is not None:
            self._check_fp8()
        elif self.first_last_layers_bf16:
            raise ConfigError("TrainingConfig.first_last_layers_bf16 (--first-last-layers-bf16): expected "
                              "--fp8-format as well (it keeps layers out of float8)")
        if self.bf16 and self.fp16:
            raise ConfigError("TrainingConfig: bf16 and fp16 are exclusive (--bf16 / --fp16: give at most one)")
        if self.torch_compile_scope != "layer" and self.torch_compile is False:
            raise ConfigError(f"TrainingConfig.torch_compile_scope (--torch-compile-scope {self.torch_compile_scope}): "
                              "expected torch compile on, got --no-torch-compile")
        for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            if getattr(self, name) != "fp32" and not self.use_precision_aware_optimizer:
                raise ConfigError(f"TrainingConfig.{name} ({flag_of(name)} {getattr(self, name)}): expected "
                                  "--use-precision-aware-optimizer as well (Megatron-LM's rule: only its optimizer "
                                  "keeps lower-precision moments)")
        if self.activation_memory_budget is not None and self.torch_compile is False:
            raise ConfigError(f"TrainingConfig.activation_memory_budget (--activation-memory-budget "
                              f"{self.activation_memory_budget:g}): expected torch compile on, got --no-torch-compile")
        if self.torch_compile_scope == "decoder" and self.recompute_granularity is not None:
            raise ConfigError(f"TrainingConfig.torch_compile_scope (--torch-compile-scope decoder): expected no "
                              f"--recompute-granularity (got {self.recompute_granularity}); use "
                              "--torch-compile-scope layer to recompute")
        if self.global_batch_size is not None and self.global_batch_size % self.micro_batch_size:
            raise ConfigError(f"TrainingConfig.global_batch_size (--global-batch-size): expected a multiple of "
                              f"--micro-batch-size {self.micro_batch_size}, got {self.global_batch_size}")
        if self.train_iters is not None and self.train_samples is not None:
            raise ConfigError(f"TrainingConfig: --train-iters ({self.train_iters}) and --train-samples "
                              f"({self.train_samples}) are exclusive: give one")
        if self.train_iters is None and self.train_samples is None:
            self.train_iters = 1  # Python callers' default; the CLI asks for one of the two
        if self.lr_warmup_fraction is not None and self.lr_warmup_iters:
            raise ConfigError(f"TrainingConfig: --lr-warmup-fraction ({self.lr_warmup_fraction}) and "
                              f"--lr-warmup-iters ({self.lr_warmup_iters}) are exclusive: give one")
        horizon = self.lr_decay_horizon or None
        if self.lr_decay_style != "constant" and horizon is not None and horizon <= self.warmup_iters:
            raise ConfigError(f"TrainingConfig.lr_warmup_iters (--lr-warmup-iters): expected fewer than the decay "
                              f"horizon {horizon} (--lr-decay-iters, else --train-iters), got {self.lr_warmup_iters}")
        if self.fp16 and self.loss_scale is None and self.min_loss_scale > self.initial_loss_scale:
            # megatron-core's DynamicGradScaler asserts min_scale <= initial_scale
            raise ConfigError(f"TrainingConfig.min_loss_scale (--min-loss-scale): expected at most --initial-loss-scale "
                              f"{self.initial_loss_scale:g}, got {self.min_loss_scale:g}")
        if self.min_lr > self.lr:
            raise ConfigError(f"TrainingConfig.min_lr (--min-lr): expected at most --lr {self.lr}, got {self.min_lr}")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ConfigError("TrainingConfig.overlap_param_gather (--overlap-param-gather): expected "
                              "--use-distributed-optimizer as well (only its params are gathered)")
        if (self.virtual_pipeline_model_parallel_size or 1) > 1 and self.pipeline_model_parallel_size == 1:
            raise ConfigError("TrainingConfig.virtual_pipeline_model_parallel_size (--virtual-pipeline-model-"
                              "parallel-size): expected --pipeline-model-parallel-size > 1, got "
                              f"{self.virtual_pipeline_model_parallel_size} with pipeline size 1")

    def _check_fp8(self) -> None:
        """What --fp8-format needs that the config alone can tell (CUDA and torchao: at model build)."""
        if not self.bf16:
            raise ConfigError(f"TrainingConfig.fp8_format (--fp8-format {self.fp8_format}): expected --bf16 as well "
                              f"(float8 linears keep bf16 weights), got {'--fp16' if self.fp16 else 'fp32'}")
        if self.tensor_model_parallel_size > 1:
            raise ConfigError(f"TrainingConfig.fp8_format (--fp8-format): float8 training is not supported with "
                              f"tensor parallelism; expected --tensor-model-parallel-size 1, got "
                              f"{self.tensor_model_parallel_size}")
        check_fp8_choice(self.fp8_format, self.fp8_recipe)

    @property
    def warmup_iters(self) -> float:
        """Warmup steps W of the LR schedule: --lr-warmup-iters, or --lr-warmup-fraction x the decay
        horizon (Megatron-LM's rule; then W may be fractional, lr = peak * n / W for n <= W)."""
        if self.lr_warmup_fraction is None:
            return self.lr_warmup_iters
        return self.lr_warmup_fraction * self.lr_decay_horizon

    # a --train-samples run, once for_global_batch made it --train-iters: train_samples / global batch
    # (may be fractional); not a field, so no flag and no dataclasses.replace carries it
    _samples_horizon = None

    @property
    def train_horizon(self) -> float:
        """Training length in steps as Megatron-LM's schedule counts it: --train-iters, or for a
        --train-samples run train_samples / global batch -- Megatron-LM counts that schedule in samples
        (lr_decay_samples and wd_incr_steps default to train_samples itself, not whole batches)."""
        return self._samples_horizon or self.train_iters or 0

    @property
    def lr_decay_horizon(self) -> float:
        """Decay horizon D of the LR schedule in steps: --lr-decay-iters, else `train_horizon`."""
        return self.lr_decay_iters or self.train_horizon

    def for_global_batch(self, global_batch_size: int) -> "TrainingConfig":
        """This config with --train-samples turned into --train-iters = train_samples // global batch
        size (Megatron-LM's rule for a constant batch size)."""
        if self.train_samples is None:
            return self
        iters = self.train_samples // global_batch_size
        if iters < 1:
            raise ConfigError(f"TrainingConfig.train_samples (--train-samples): expected at least one global "
                              f"batch ({global_batch_size} samples), got {self.train_samples}")
        out = dataclasses.replace(self, train_iters=iters, train_samples=None)
        out._samples_horizon = self.train_samples / global_batch_size
        return out

    def compiles(self, device) -> bool:
        """Whether a model built for `device` is compiled: --torch-compile / --no-torch-compile as given;
        unset, on for a CUDA device (and wherever --torch-compile-scope decoder or --activation-memory-budget,
        options of the compiled regions, ask for it), off elsewhere."""
        if self.torch_compile is not None:
            return self.torch_compile
        asked = self.torch_compile_scope != "layer" or self.activation_memory_budget is not None
        return asked or (device is not None and torch.device(device).type == "cuda")

    def compile_options(self, device, **torch_compile_kwargs) -> dict | bool:
        """build_model's `compile` for a model on `device`: False (`compiles` says no), or the regional
        compile's options -- `torch_compile_kwargs` for torch.compile, the scope, the memory budget, and
        the eager fallback where compile is only the default (a machine that cannot compile warns and
        trains eager; asked for, the failure is raised)."""
        if not self.compiles(device):
            return False
        return {**torch_compile_kwargs, "scope": self.torch_compile_scope, "memory_budget": self.activation_memory_budget,
                "fallback": self.torch_compile is None}

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
        # Megatron-LM's `args` names where they differ from the flag (--fp8-format stores args.fp8)
        data = {MEGATRON_DESTS.get(k, k): v for k, v in data.items()}
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            hints = {u: difflib.get_close_matches(u, names, n=1) for u in unknown}
            hint = "; ".join(f"{u!r}: did you mean {m[0]!r}?" for u, m in hints.items() if m)
            raise ConfigError(f"TrainingConfig: unknown field(s) {unknown} (expected Megatron-LM argument names "
                              f"such as micro_batch_size, lr, clip_grad{'; ' + hint if hint else ''})")
        return cls(**data)


@dataclass(kw_only=True)
class RunConfig(ModelFlags):
    """What to train on and where to write: everything that is not a TrainingConfig field.  The model
    is --hf-model, --hf-config, Megatron-LM's model flags (`ModelFlags`, training/model_flags.py) or,
    on --load / --pretrained-checkpoint, the checkpoint's own."""

    hf_model: str | None = option(None, group="model", help="HF folder or Hub id: pretrained weights and config (this or --hf-config)")
    hf_config: str | None = option(None, group="model",
                                   help="HF config.json (file or folder): fresh Megatron-style init")
    data_path: list[str] = option(group="data", help="prefix, or 'w1 prefix1 w2 prefix2 ...'")
    split: str = option("969,30,1", group="data", help="train,valid,test shares of the documents")
    seq_length: int = option(1024, group="data", at_least=2, help="tokens per sample")
    data_cache_path: str | None = option(None, group="data",
                                         help="where the index .npy files go (default: <data dir>/cache)")
    sft: bool = option(False, group="data", help="supervised fine-tuning on an SFT dataset from `preprocess --sft`: "
                                                 "only response tokens are scored (train and validation loss)")
    sft_pack: bool = option(False, group="data", help="with --sft: pack several samples into each --seq-length "
                                                      "window (default: one sample per window, right-padded)")
    save: str | None = option(None, group="checkpointing and logging", help="checkpoint folder to write")
    save_interval: int | None = option(None, group="checkpointing and logging", at_least=1,
                                       help="save every N steps (default: only at the end)")
    load: str | None = option(
        None, group="checkpointing and logging",
        help="checkpoint folder to resume from (the folder holding latest_checkpointed_iteration.txt); a missing "
             "or empty folder is an error, except when it is this run's --save folder (a new run starts fresh)")
    ckpt_step: int | None = option(None, group="checkpointing and logging", at_least=0,
                                   help="with --load: load this iteration (its iter_* folder) instead of the one "
                                        "latest_checkpointed_iteration.txt names (Megatron-LM's --ckpt-step)")
    ckpt_format: str = option(
        "torch", group="checkpointing and logging", choices=CKPT_FORMATS,
        help="format of the checkpoints --save writes: Megatron-LM's torch (mp_rank_* files) or torch_dist "
             "(megatron-core's distributed checkpoint; not with --use-distributed-optimizer); --load "
             "reads torch and torch_dist checkpoints whatever this is")
    no_save_optim: bool = option(False, group="checkpointing and logging",
                                 help="save no optimizer state and LR schedule (as Megatron-LM: resuming the "
                                      "checkpoint then needs --no-load-optim)")
    no_save_rng: bool = option(False, group="checkpointing and logging",
                               help="save no RNG state (as Megatron-LM: resuming the checkpoint then needs "
                                    "--no-load-rng)")
    pretrained_checkpoint: str | None = option(
        None, group="fine-tuning",
        help="weights to fine-tune when --load holds no checkpoint yet: a Megatron checkpoint folder (also a "
             "converted weights-only one), an HF folder or a Hub id; implies --finetune for that load")
    finetune: bool = option(False, group="fine-tuning",
                            help="load weights only: iteration 0, fresh optimizer, LR schedule and RNG")
    no_load_optim: bool = option(False, group="fine-tuning",
                                 help="on --load: fresh optimizer and, as Megatron-LM, fresh LR schedule")
    no_load_rng: bool = option(False, group="fine-tuning", help="do not load the RNG state on --load")
    override_opt_param_scheduler: bool = option(
        False, group="fine-tuning", aliases=("--override-opt_param-scheduler",),
        help="on --load, take the LR schedule's shape (lr, min lr, warmup, decay) from the flags, not the checkpoint")
    use_checkpoint_opt_param_scheduler: bool = option(
        False, group="fine-tuning", aliases=("--use-checkpoint-opt_param-scheduler",),
        help="on --load, take the LR schedule's shape from the checkpoint (default: both must agree)")
    hidden_dropout: float | None = option(None, group="fine-tuning", at_least=0.0, below=1.0,
                                          help="dropout on embeddings and residual branches (default: the model's; 0.1 "
                                               "with the model flags, as Megatron-LM)")
    attention_dropout: float | None = option(None, group="fine-tuning", at_least=0.0, below=1.0,
                                             help="dropout on attention probabilities (default: the model's; 0.1 with the "
                                                  "model flags, as Megatron-LM)")
    exit_interval: int | None = option(None, group="exit", at_least=1,
                                       help="save and exit 0 when the iteration is a multiple of N")
    exit_duration_in_mins: float | None = option(None, group="exit", above=0.0,
                                                 help="save and exit 0 after this many minutes of training")
    exit_signal_handler: bool = option(False, group="exit",
                                       help="on SIGTERM or SIGINT: finish the step, save, exit 0")
    exit_on_missing_checkpoint: bool = option(
        False, group="exit", help="with --load: fail when no checkpoint is found, even in the --save folder")
    no_check_for_nan_in_loss_and_grad: bool = option(
        False, group="exit",
        help="fp32/bf16: do not stop at a non-finite loss or gradient (the step is skipped and counted instead); "
             "fp16 always skips overflowing steps (loss scaling)")
    log_interval: int = option(10, group="checkpointing and logging", at_least=1, help="print every N steps")
    eval_interval: int | None = option(None, group="checkpointing and logging", at_least=1,
                                       help="evaluate on the valid split every N steps (default: never)")
    eval_iters: int = option(10, group="checkpointing and logging", at_least=0,
                             help="global batches per evaluation; 0 turns validation off (Megatron-LM's rule)")
    tensorboard_dir: str | None = option(None, group="checkpointing and logging", help="TensorBoard log folder")
    no_checkpoint_checksums: bool = option(False, group="checkpointing and logging",
                                           help="neither write nor verify sha256 sidecars of checkpoint files")
    tokenizer_type: str | None = option(
        None, group="tokenizer", choices=TOKENIZER_TYPES,
        help="Megatron-LM's tokenizer kind: HuggingFaceTokenizer (and the SentencePiece kinds) read "
             "--tokenizer-model; GPT2BPETokenizer reads --vocab-file and --merge-file; NullTokenizer has none "
             "(--vocab-size) (default: --tokenizer-model's kind, else the model folder's tokenizer)")
    vocab_file: str | None = option(None, group="tokenizer", help="GPT-2 vocab.json, with --tokenizer-type "
                                                                  "GPT2BPETokenizer")
    merge_file: str | None = option(None, group="tokenizer", help="GPT-2 merges.txt, with --tokenizer-type "
                                                                  "GPT2BPETokenizer")
    tokenizer_model: str | None = option(None, group="tokenizer",
                                         help="the run's tokenizer (text samples, <save>/tokenizer, the model "
                                              "flags' vocabulary): HF folder, Hub id or SentencePiece .model "
                                              "(default: the --hf-model / --hf-config folder's, if any)")
    sample_prompt: str | None = option(None, group="monitoring",
                                       help="at each evaluation, continue this text and log it (default: no samples)")
    sample_tokens: int = option(32, group="monitoring", at_least=1, help="tokens generated per text sample")
    sample_temperature: float = option(0.0, group="monitoring", at_least=0.0,
                                       help="sampling temperature of the text samples; 0 = greedy")
    peak_tflops: float | None = option(None, group="monitoring", above=0.0,
                                       help="peak TFLOP/s per GPU for MFU (default: looked up by GPU name and precision)")
    no_progress_bar: bool = option(False, group="monitoring",
                                   help="no tqdm progress bar (it is shown only when stdout is a terminal)")
    distributed_backend: str | None = option(
        None, group="parallelism", choices=("nccl", "gloo"),
        help="torch.distributed backend under torchrun: nccl needs CUDA GPUs, gloo runs on CPUs (default: nccl "
             "on GPUs, gloo on CPUs)")

    def __post_init__(self) -> None:
        check_fields(self)
        from_checkpoint = bool(self.pretrained_checkpoint or self.load)  # it can give the model's structure
        from_flags = self.check_model_flags()
        if (self.hf_model and self.hf_config) or not (from_checkpoint or from_flags or self.hf_model
                                                      or self.hf_config):
            raise ConfigError("RunConfig: give exactly one of --hf-model (pretrained weights), --hf-config "
                              "(fresh init from a config.json) or Megatron-LM's model flags (--num-layers, "
                              f"--hidden-size, --num-attention-heads, ...), got hf_model={self.hf_model!r}, "
                              f"hf_config={self.hf_config!r} (with --load / --pretrained-checkpoint all may be "
                              "left out: the checkpoint's own config is used)")
        self._check_tokenizer_flags()
        if from_flags:  # Megatron-LM's default dropouts come with its model flags
            self.hidden_dropout = MEGATRON_DROPOUT if self.hidden_dropout is None else self.hidden_dropout
            self.attention_dropout = MEGATRON_DROPOUT if self.attention_dropout is None else self.attention_dropout
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ConfigError("RunConfig: --override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler "
                              "are exclusive: give one")
        from ..data.builder import parse_data_path, split_bookends
        # a bad --data-path blend or --split fails here, before any model is built
        parse_data_path(self.data_path)
        split_bookends(self.split)
        if self.sft_pack and not self.sft:
            raise ConfigError("RunConfig.sft_pack (--sft-pack): expected --sft as well (packing applies to SFT data)")


    def validates(self) -> bool:
        """Validation runs: --eval-interval set, --eval-iters > 0 and a valid share in --split."""
        from ..data.builder import split_bookends
        return bool(self.eval_interval and self.eval_iters and split_bookends(self.split)[1] is not None)

    def startup_warnings(self) -> list[str]:
        """Flags Megatron-LM accepts but that do nothing here (one warning line each at startup):
        an --eval-interval over a split without a valid share (--eval-iters 0 is Megatron-LM's way to
        turn validation off: no warning for it), a --save-interval without --save, an SFT dataset (one
        with the loss mask `preprocess --sft` writes) trained without --sft (every token scored)."""
        from ..data.builder import parse_data_path
        from ..data.indexed import idx_path
        from ..data.sft_records import loss_mask_prefix
        lines = []
        prefixes, _ = parse_data_path(self.data_path)
        sft_data = [p for p in prefixes if os.path.isfile(idx_path(loss_mask_prefix(p)))]
        if sft_data and not self.sft:
            lines.append(f"--data-path {sft_data[0]} is an SFT dataset (it has a loss mask) trained as pretraining "
                         "text (every token, packed windows); give --sft to train on response tokens only")
        if self.eval_interval and self.eval_iters and not self.validates():
            lines.append(f"--eval-interval {self.eval_interval}: no validation runs, the valid split of --split "
                         f"{self.split} has no share")
        if self.save_interval and not self.save:
            lines.append(f"--save-interval {self.save_interval}: no checkpoint is saved without --save")
        return lines

    def _check_tokenizer_flags(self) -> None:
        bpe_files = [f for f, v in (("--vocab-file", self.vocab_file), ("--merge-file", self.merge_file)) if v]
        if self.tokenizer_type == "GPT2BPETokenizer" and len(bpe_files) < 2:
            raise ConfigError("RunConfig.tokenizer_type (--tokenizer-type GPT2BPETokenizer): expected --vocab-file "
                              "and --merge-file (GPT-2's vocab.json and merges.txt)")
        if bpe_files and self.tokenizer_type != "GPT2BPETokenizer":
            raise ConfigError(f"RunConfig: {bpe_files[0]} is read with --tokenizer-type GPT2BPETokenizer, got "
                              f"--tokenizer-type {self.tokenizer_type}")
        if self.tokenizer_type and self.tokenizer_type not in ("GPT2BPETokenizer", "NullTokenizer") \
                and not self.tokenizer_model:
            raise ConfigError(f"RunConfig.tokenizer_model (--tokenizer-model): expected a tokenizer for "
                              f"--tokenizer-type {self.tokenizer_type}")
        if self.tokenizer_type == "NullTokenizer" and self.tokenizer_model:
            raise ConfigError("RunConfig.tokenizer_model (--tokenizer-model): --tokenizer-type NullTokenizer has no "
                              "tokenizer; leave --tokenizer-model out")


def same_as(cls: type, name: str):
    """Field `name` of dataclass `cls` declared again in another config: one default, help text,
    flag group and set of bounds for both (the annotation is still written at the new place)."""
    original = cls.__dataclass_fields__[name]
    return field(default=original.default, metadata=original.metadata)


EVAL_SPLITS = ("train", "valid", "test")


@dataclass(kw_only=True)
class EvalConfig:
    """`hf-megatron evaluate`: the loss and perplexity of a model on one split of a dataset."""

    load: str | None = option(None, group="model",
                              help="Megatron checkpoint folder to score, saved in any layout (this or --hf-model)")
    hf_model: str | None = option(None, group="model", help="HF folder or Hub id to score (this or --load)")
    data_path: list[str] = same_as(RunConfig, "data_path")
    split: str | None = option(None, group="data", help="train,valid,test shares of the documents "
                                                        "(default: the checkpoint's training --split, else 969,30,1)")
    eval_split: str = option("valid", group="data", choices=EVAL_SPLITS,
                             help="the split to score; a held-out prefix of its own: --split 0,1,0")
    seq_length: int | None = option(None, group="data", at_least=2,
                                    help="tokens per sample (default: the checkpoint's training --seq-length, "
                                         "else the smaller of 1024 and the model's positions)")
    data_cache_path: str | None = same_as(RunConfig, "data_cache_path")
    sft: bool = option(False, group="data",
                       help="score an SFT dataset from `preprocess --sft` as `train --sft` does: response tokens only "
                            "(default: on for a checkpoint trained with --sft)")
    sft_pack: bool = option(False, group="data", help="with --sft: samples packed as `train --sft-pack` packs them "
                                                      "(default: the checkpoint's training --sft-pack)")
    eval_iters: int | None = option(None, group="data", at_least=1,
                                    help="global batches to score (default: the checkpoint's training --eval-iters for the "
                                         "valid split of a run that validated, else every full global batch), from "
                                         "the split's start, or for a checkpoint's own valid split (no --split) from "
                                         "its latest validation's first sample")
    micro_batch_size: int = same_as(TrainingConfig, "micro_batch_size")
    global_batch_size: int | None = option(None, group="training", at_least=1,
                                           help="samples per evaluation step over all dp ranks (default: the "
                                                "checkpoint's training --global-batch-size, else micro batch x dp)")
    tensor_model_parallel_size: int = same_as(TrainingConfig, "tensor_model_parallel_size")
    pipeline_model_parallel_size: int = same_as(TrainingConfig, "pipeline_model_parallel_size")
    virtual_pipeline_model_parallel_size: int | None = same_as(TrainingConfig, "virtual_pipeline_model_parallel_size")
    sequence_parallel: bool = same_as(TrainingConfig, "sequence_parallel")
    bf16: bool = same_as(TrainingConfig, "bf16")
    fp16: bool = same_as(TrainingConfig, "fp16")
    seed: int | None = option(None, group="training", at_least=0,
                              help="seed of the data shuffling (default: the checkpoint's training --seed, else 1234)")

    def __post_init__(self) -> None:
        check_fields(self)
        if bool(self.load) == bool(self.hf_model):
            raise ConfigError("EvalConfig: give exactly one of --load (a Megatron checkpoint) or --hf-model (an HF "
                              f"folder or Hub id), got load={self.load!r}, hf_model={self.hf_model!r}")
        if self.sft_pack and not self.sft:
            raise ConfigError("EvalConfig.sft_pack (--sft-pack): expected --sft as well (packing applies to SFT data)")
        from ..data.builder import parse_data_path, split_bookends
        parse_data_path(self.data_path)  # a bad blend fails before the checkpoint is read
        if self.split is not None and split_bookends(self.split)[EVAL_SPLITS.index(self.eval_split)] is None:
            _fail(self, "split", f"a non-zero share for the {self.eval_split} split (--eval-split)", self.split)

    def with_recorded(self, recorded: dict) -> "EvalConfig":
        """Unset data fields filled from a training checkpoint's args (Megatron-LM's names), then
        from training's defaults; the run's --eval-iters only when scoring the valid split."""
        names = ("split", "seed", "seq_length", "global_batch_size") + (("eval_iters",) if self.eval_split == "valid" else ())
        fallback = {"split": RunConfig.__dataclass_fields__["split"].default, "seed": TrainingConfig.seed}
        # a run without --eval-interval (or with --eval-iters 0) did not validate: its eval_iters is no count
        recorded = {**recorded, "eval_iters": (recorded.get("eval_interval") and recorded.get("eval_iters")) or None}
        values = {n: recorded.get(n) if recorded.get(n) is not None else fallback.get(n)
                  for n in names if getattr(self, n) is None}
        if not self.sft and recorded.get("sft"):  # scored as the run scored it: response tokens only
            values.update(sft=True, sft_pack=bool(recorded.get("sft_pack")))
        return dataclasses.replace(self, **values)

    def training_config(self) -> TrainingConfig:
        """The layout, precision and batch fields as the TrainingConfig that builds and runs the model."""
        names = {f.name for f in dataclasses.fields(TrainingConfig)}
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in names}
        return TrainingConfig(**{k: v for k, v in values.items() if v is not None})

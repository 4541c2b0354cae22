"""accelerate's `MegatronLMPlugin` and `MegatronLMDummyScheduler` -> our TrainingConfig and LR schedule.

accelerate's `accelerate launch` turns a config file's `megatron_lm_config` into MEGATRON_LM_*
variables, which the plugin reads in `__post_init__`; we read the plugin, never the variables.

Batch sizes, as accelerate's Megatron-LM integration defines them:
    micro_batch_size   = the prepared DataLoaders' batch size (the smallest, `is_train_batch_min`)
    global_batch_size  = dp x micro_batch_size x num_micro_batches
and every prepared DataLoader yields dp rank's share of one global batch, micro_batch_size x
num_micro_batches samples.  `plugin.set_training_args` (accelerate's own method) records them.

`MegatronLMDummyScheduler(optimizer, total_num_steps, warmup_num_steps)` becomes Megatron's
schedule as accelerate's `set_scheduler_args` derives it: train_iters = total_num_steps // dp,
lr_warmup_iters = warmup_num_steps // dp, decay style / horizon / floor from the plugin
(`lr_decay_style`, `lr_decay_iters`, `min_lr`).
"""
from __future__ import annotations

import os

from ...errors import ConfigError
from ...training import trainer

ENV_FLAG = "ACCELERATE_USE_MEGATRON_LM"

# plugin features that hand accelerate a piece of NVIDIA's Megatron-LM to run; we run our own
_UNSUPPORTED = {
    "custom_train_step_class": "subclass nothing: the engine's train step is the model's forward",
    "custom_loss_function": "pass labels (-100 = not scored) in the batch instead",
    "custom_get_batch_function": "give the batch as input_ids / labels / attention_mask tensors",
    "custom_model_provider_function": "prepare a transformers model instead",
    "custom_prepare_model_function": "prepare a transformers model instead",
    "custom_megatron_datasets_provider_function": "use hf_megatron.data.build_gpt_datasets + a DataLoader",
    "train_samples": "use MegatronLMDummyScheduler(total_num_steps=...) or train_iters",
    "lr_warmup_samples": "use MegatronLMDummyScheduler(warmup_num_steps=...)",
    "lr_decay_samples": "use lr_decay_iters",
    "lr_warmup_fraction": "use MegatronLMDummyScheduler(warmup_num_steps=...)",
}


def megatron_requested(plugin=None) -> bool:
    return plugin is not None or os.environ.get(ENV_FLAG, "false").lower() == "true"


def check_plugin(plugin) -> None:
    """One line naming a plugin field we cannot honour, and what to do instead."""
    for name, instead in _UNSUPPORTED.items():
        if getattr(plugin, name, None) is not None:
            raise ConfigError(f"MegatronLMPlugin.{name} is not supported by hf_megatron's Accelerator; {instead}")
    if getattr(plugin, "megatron_dataset_flag", False):
        raise ConfigError("MegatronLMPlugin.megatron_dataset_flag / MegatronLMDummyDataLoader are not supported; "
                          "build the datasets with hf_megatron.data.build_gpt_datasets and pass a DataLoader")


def training_config_from_plugin(plugin, mixed_precision: str) -> trainer.TrainingConfig:
    """accelerate's MegatronLMPlugin (+ mixed precision) -> our TrainingConfig (Megatron names)."""
    check_plugin(plugin)
    if plugin.num_micro_batches is not None and int(plugin.num_micro_batches) < 1:
        raise ConfigError(f"accelerate config: megatron_lm_num_micro_batches={plugin.num_micro_batches}: expected a "
                          f"positive number of micro batches per step")
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
        lr_decay_style=plugin.lr_decay_style or "linear",
        min_lr=float(plugin.min_lr or 0.0),
        bf16=mixed_precision == "bf16",
        fp16=mixed_precision == "fp16",
    )
    if plugin.num_layers_per_virtual_pipeline_stage:
        raise ConfigError("MegatronLMPlugin.num_layers_per_virtual_pipeline_stage is not supported; set "
                          "other_megatron_args={'virtual_pipeline_model_parallel_size': N} instead")
    fields.update(other)
    # an accelerate script compiles when it asks (accelerate's own default is no dynamo backend; the
    # Accelerator maps its dynamo plugin onto this), not by default
    fields.setdefault("torch_compile", False)
    if fields.get("defer_step_stats"):
        raise ConfigError("megatron_lm_config / other_megatron_args: defer_step_stats is an option of `hf-megatron "
                          "train`'s own loop; an accelerate script reads its losses itself (leave it out)")
    try:
        return trainer.TrainingConfig.from_dict(fields)
    except ConfigError as exc:
        raise ConfigError(f"megatron_lm_config / other_megatron_args: {exc}") from None


def schedule_fields(plugin, scheduler, dp: int) -> dict:
    """TrainingConfig fields of a MegatronLMDummyScheduler (accelerate's `set_scheduler_args`)."""
    if scheduler.kwargs:
        raise ConfigError(f"MegatronLMDummyScheduler: keyword(s) {sorted(scheduler.kwargs)} are not used; set "
                          f"lr_decay_style / lr_decay_iters / min_lr on MegatronLMPlugin instead")
    train_iters = plugin.train_iters
    if train_iters is None:
        if not scheduler.total_num_steps:
            raise ConfigError("MegatronLMDummyScheduler(total_num_steps=...): expected the number of training "
                              "steps (or MegatronLMPlugin(train_iters=...)), got None")
        train_iters = max(int(scheduler.total_num_steps) // dp, 1)
    warmup = plugin.lr_warmup_iters
    if warmup is None:
        warmup = int(scheduler.warmup_num_steps or 0) // dp
    return {"train_iters": train_iters, "lr_warmup_iters": warmup, "lr_decay_iters": plugin.lr_decay_iters}

"""`Accelerator`: accelerate's, with its Megatron-LM path run by hf_megatron (NVIDIA's `megatron` not needed).

Under a Megatron-LM config (`distributed_type: MEGATRON_LM`, or `megatron_lm_plugin=` given)
it behaves as accelerate documents its Megatron-LM integration:
* `distributed_type` is `DistributedType.MEGATRON_LM`, `state.megatron_lm_plugin` the plugin
  (with `micro_batch_size`, `global_batch_size`, `num_micro_batches`, `return_logits`, ...);
  `num_processes` is the world size; `is_main_process` / `is_local_main_process` are the *last*
  rank, as accelerate documents (where Megatron keeps losses; here every rank has them).
  `wait_for_everyone` / `main_process_first` really wait (accelerate's skip MEGATRON_LM).
* `prepare` takes the objects in any calls and any order and returns the engine (engine.py),
  optimizer and scheduler stand-ins whose step() / zero_grad() do nothing (the engine steps),
  and dp-sharded DataLoaders (loaders.py).
* `save_state` / `load_state`: a Megatron-LM checkpoint (state.py); `save_model`,
  `get_state_dict`, `unwrap_model`: full weights under transformers' names (weights.py).
* `gather` / `gather_for_metrics` / `reduce` run over the data-parallel group (metrics.py);
  `clip_grad_norm_` after a batch that only accumulated is plain accelerate's (clipping.py).
Without a Megatron config it is plain `accelerate.Accelerator`.
"""
from __future__ import annotations

import contextlib
import os

import accelerate
import torch
import torch.distributed as dist
from accelerate.utils import DistributedType, MegatronLMDummyScheduler
from torch import nn

from ...config import ModelConfig
from ...errors import ConfigError
from ...parallel import state
from ...training import trainer
from . import metrics, state_io
from .clipping import clip_accumulated_
from .engine import EngineRNG, MegatronEngine, follow_user_lr
from .loaders import prepare_loader
from .param_groups import chunk_param_groups, hf_param_refs
from .plugin import ENV_FLAG, megatron_requested, schedule_fields, training_config_from_plugin
from .user_errors import check_model_fits, check_world, install_excepthook
from .weights import gather_full, hf_state_dict, transformers_model, write_hf_folder
from .wrappers import PreparedOptimizer, PreparedScheduler


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


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _barrier() -> None:
    if _distributed():
        dist.barrier()


class Accelerator(accelerate.Accelerator):
    def __init__(self, *args, **kwargs):
        install_excepthook()  # a bad input leaves the script as one line, not a traceback per rank
        plugin = kwargs.pop("megatron_lm_plugin", None)
        self.megatron = megatron_requested(plugin)
        if not self.megatron:
            super().__init__(*args, **kwargs)
            return
        from accelerate.utils import MegatronLMPlugin
        plugin = plugin or MegatronLMPlugin()
        if kwargs.get("device_placement") is False:
            raise ConfigError("Accelerator(device_placement=False) is not supported with Megatron-LM "
                              "(accelerate refuses it too); leave device placement on")
        if not torch.cuda.is_available():
            kwargs["cpu"] = True  # no GPU: the processes are CPU processes (gloo), whatever `cpu` says
        # accelerate would insist on NVIDIA's megatron package: initialise as plain multi-process
        with _env(ENV_FLAG, "false"):
            super().__init__(*args, **kwargs)
        if self.state.device.type == "cpu":
            # plain accelerate's CPU device is `cpu`, what CPU tensors report (its multi-process CPU state
            # names `cpu:0`, which compares unequal to every tensor's .device)
            self.state.device = accelerate.state.PartialState._shared_state["device"] = torch.device("cpu")
        self.megatron_config = training_config_from_plugin(plugin, self.mixed_precision)
        # accelerate's dynamo plugin (--dynamo_backend, Accelerator(dynamo_backend=...)): accelerate compiles the
        # prepared model with it; here its torch.compile keywords go to our regional compile of each layer
        dynamo = self.state.dynamo_plugin
        self._compile_kwargs = dynamo.to_kwargs() if dynamo is not None and dynamo.backend.value != "NO" else None
        if self._compile_kwargs is not None:
            self.megatron_config.torch_compile = True
        check_world(self.num_processes, self.megatron_config.tensor_model_parallel_size,
                    self.megatron_config.pipeline_model_parallel_size)
        self.megatron_grid = trainer.setup_parallel(self.megatron_config)
        plugin.set_mixed_precision(self.mixed_precision)
        plugin.micro_batch_size = getattr(plugin, "micro_batch_size", None)
        plugin.global_batch_size = getattr(plugin, "global_batch_size", None)
        self.state.megatron_lm_plugin = plugin
        # what accelerate itself sets under Megatron-LM: both states (every AcceleratorState()
        # call copies PartialState's fields over its own)
        self.state.distributed_type = DistributedType.MEGATRON_LM
        accelerate.state.PartialState._shared_state["distributed_type"] = DistributedType.MEGATRON_LM
        self._engine: MegatronEngine | None = None
        self._hf_refs = None
        self._pending: list = []  # optimizer / scheduler stand-ins waiting for the model

    # ------------------------------------------------------------------ helpers
    @property
    def _plugin(self):
        return self.state.megatron_lm_plugin


    def _need_engine(self, api: str) -> MegatronEngine:
        if self._engine is None:
            raise ConfigError(f"accelerator.{api}: no model was prepared; call accelerator.prepare(model) first")
        return self._engine

    # ------------------------------------------------------------------ prepare
    def prepare(self, *args, device_placement=None):
        if not self.megatron:
            return super().prepare(*args, device_placement=device_placement)
        if device_placement is not None:
            raise ConfigError("accelerator.prepare(device_placement=...) is not supported with Megatron-LM; "
                              "leave it out")
        loaders = [obj for obj in args if isinstance(obj, torch.utils.data.DataLoader)]
        if loaders and self._plugin.micro_batch_size is None:
            sizes = [self._micro_batch_of(obj.batch_size) for obj in loaders if obj.batch_size]
            if sizes:  # accelerate: is_train_batch_min picks the smallest (else the largest)
                self._set_micro_batch_size(min(sizes) if self._plugin.is_train_batch_min else max(sizes))
        kinds = ((nn.Module, self.prepare_model), (torch.optim.Optimizer, self.prepare_optimizer),
                 ((torch.optim.lr_scheduler.LRScheduler, MegatronLMDummyScheduler), self.prepare_scheduler),
                 (torch.utils.data.DataLoader, self.prepare_data_loader))
        result = list(args)
        for kind, prepare in kinds:  # models first: optimizers and schedulers bind to them
            for i, obj in enumerate(args):
                if isinstance(obj, kind):
                    result[i] = prepare(obj)
        return result[0] if len(result) == 1 else tuple(result)

    def _micro_batch_of(self, batch_size: int) -> int:
        """A DataLoader's batch_size -> the micro batch size: itself, or with split_batches (plain accelerate:
        the loader's batch is the batch across the processes) its share per data-parallel rank."""
        dp = state.get_state().dp
        if not self.split_batches:
            return batch_size
        if batch_size % dp:
            raise ConfigError(f"DataLoaderConfiguration(split_batches=True): the DataLoader's batch_size={batch_size} "
                              f"is split over the {dp} data-parallel ranks; use a multiple of {dp}")
        return batch_size // dp

    def _set_micro_batch_size(self, micro_batch_size: int) -> None:
        plugin, grid = self._plugin, state.get_state()
        plugin.set_training_args(int(micro_batch_size), grid.dp)  # accelerate's: micro, dp and global batch size
        self.megatron_config.micro_batch_size = plugin.micro_batch_size
        self.megatron_config.global_batch_size = plugin.global_batch_size

    def prepare_model(self, model: nn.Module, device_placement=None, evaluation_mode: bool = False):
        if not self.megatron:
            return super().prepare_model(model, device_placement, evaluation_mode)
        if isinstance(model, MegatronEngine):
            return model
        if self._engine is not None:
            raise ConfigError("accelerator.prepare: a second model; one Accelerator holds one model under "
                              "Megatron-LM (as in accelerate)")
        if not hasattr(model, "config"):
            raise ConfigError(f"accelerator.prepare: {type(model).__name__} is not a transformers causal LM "
                              f"(expected e.g. AutoModelForCausalLM.from_pretrained(...))")
        cfg = self.megatron_config
        model_config = ModelConfig.from_hf(model.config.to_dict())
        check_model_fits(model_config, model.config, cfg.tensor_model_parallel_size,
                         cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size or 1)
        # built under init_empty_weights: a fresh Megatron init now, weights from load_state later
        source = model_config if any(p.is_meta for p in model.parameters()) else model
        # the build seeds and draws on the engine's own stream; the user's generators stay as plain accelerate's
        chunks, rng = EngineRNG.build(lambda: trainer.build_model(
            source, cfg, device=self.device, compile=cfg.compile_options(self.device, **(self._compile_kwargs or {}))))
        self._engine = MegatronEngine(chunks, cfg, model.config, self, rng=rng)
        self._hf_refs = hf_param_refs(model)
        self._models.append(self._engine)
        for pending in self._pending:
            self._bind(pending)
        self._pending.clear()
        return self._engine

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement=None):
        if not self.megatron:
            return super().prepare_optimizer(optimizer, device_placement)
        if isinstance(optimizer, PreparedOptimizer):
            return optimizer
        if "adam" not in type(optimizer).__name__.lower():
            raise ConfigError(f"accelerator.prepare: optimizer {type(optimizer).__name__} is not supported under "
                              f"Megatron-LM; use torch.optim.AdamW (Megatron's Adam with decoupled weight decay)")
        wrapped = PreparedOptimizer(optimizer, self)
        self._optimizers.append(wrapped)
        self._defer_or_bind(wrapped)
        return wrapped

    def prepare_scheduler(self, scheduler):
        if not self.megatron:
            return super().prepare_scheduler(scheduler)
        if isinstance(scheduler, PreparedScheduler):
            return scheduler
        wrapped = PreparedScheduler(scheduler, self)
        self._schedulers.append(wrapped)
        self._defer_or_bind(wrapped)
        return wrapped

    def _defer_or_bind(self, wrapped) -> None:
        if self._engine is None or (isinstance(wrapped, PreparedScheduler) and self._engine.optimizer is None):
            self._pending.append(wrapped)
        else:
            self._bind(wrapped)

    def _bind(self, wrapped) -> None:
        """Build our optimizer / schedule for a prepared stand-in, now that the model exists."""
        engine, cfg = self._engine, self.megatron_config
        if isinstance(wrapped, PreparedScheduler):
            if engine.optimizer is None:
                self._pending.append(wrapped)
                return
            original = wrapped.original
            if isinstance(original, MegatronLMDummyScheduler):
                fields = schedule_fields(self._plugin, original, state.get_state().dp)
                for name, value in fields.items():
                    setattr(cfg, name, value)
                engine.scheduler = trainer.build_scheduler(engine.optimizer, cfg)
            else:  # a torch schedule: scheduler.step() steps it as accelerate's AcceleratedScheduler, we follow its lr
                engine.user_scheduler = original
                follow_user_lr(engine.optimizer, original)
            wrapped.bind(engine)
            return
        optimizer = wrapped.original
        defaults = optimizer.defaults
        cfg.lr = float(defaults.get("lr", optimizer.param_groups[0]["lr"]))
        cfg.weight_decay = float(defaults.get("weight_decay", 0.0))
        cfg.adam_beta1, cfg.adam_beta2 = defaults.get("betas", (0.9, 0.999))
        cfg.adam_eps = float(defaults.get("eps", 1e-8))
        groups = chunk_param_groups(optimizer, self._hf_refs, list(engine.chunks))
        engine.optimizer = trainer.build_optimizer(list(engine.chunks), cfg, groups=groups)
        wrapped.bind(engine)
        for pending in [p for p in self._pending if isinstance(p, PreparedScheduler)]:
            self._pending.remove(pending)
            self._bind(pending)

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        if not self.megatron:
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        if self._plugin.micro_batch_size is None:
            if not data_loader.batch_size:
                raise ConfigError("accelerator.prepare: a DataLoader without batch_size; give it "
                                  "batch_size=<micro batch size>")
            self._set_micro_batch_size(self._micro_batch_of(data_loader.batch_size))
        per_step = self._plugin.micro_batch_size * int(self._plugin.num_micro_batches or 1)
        prepared = prepare_loader(data_loader, per_step, self.device, self.rng_types, self.dataloader_config)
        self._dataloaders.append(prepared)
        return prepared

    # ------------------------------------------------------------------ the step runs inside the engine
    def backward(self, loss, **kwargs):
        if not self.megatron:
            return super().backward(loss, **kwargs)
        return None  # as accelerate's Megatron-LM path: the engine has run backward and the step

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """Under Megatron-LM the engine clips inside `model(**batch)` (at megatron_lm_gradient_clipping);
        after a batch that updated, this returns that update's total gradient norm before clipping, as
        torch's clip_grad_norm_ does (as accelerate's DeepSpeed path, which also clips inside its engine;
        None before the first update; inf for an update skipped for a non-finite gradient).  After a batch
        that only accumulated it is plain accelerate's: the norm of the gradients accumulated so far, which
        it clips in place (clipping.py)."""
        if not self.megatron:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        if float(max_norm) != float(self.megatron_config.clip_grad):
            raise ConfigError(f"accelerator.clip_grad_norm_(max_norm={max_norm}): under Megatron-LM the engine clips "
                              f"inside model(**batch) at megatron_lm_gradient_clipping="
                              f"{self.megatron_config.clip_grad}; set that instead")
        if float(norm_type) != 2.0:
            raise ConfigError(f"accelerator.clip_grad_norm_(norm_type={norm_type}): under Megatron-LM the engine clips "
                              f"by the L2 norm (norm_type=2)")
        engine = self._need_engine("clip_grad_norm_")
        if engine.accumulated:
            return clip_accumulated_(engine, max_norm)
        norm = engine.grad_norm
        return None if norm is None else torch.tensor(norm, dtype=torch.float32, device=self.device)

    def clip_grad_value_(self, parameters, clip_value):
        if not self.megatron:
            return super().clip_grad_value_(parameters, clip_value)
        raise ConfigError(f"accelerator.clip_grad_value_(clip_value={clip_value}): under Megatron-LM the engine clips inside "
                          f"model(**batch) by the total L2 norm (megatron_lm_gradient_clipping="
                          f"{self.megatron_config.clip_grad}); value clipping is not available")

    @contextlib.contextmanager
    def autocast(self, autocast_handler=None):
        """Plain accelerate's autocast for the script's own code: torch.autocast in the mixed precision's dtype
        where accelerate enables it (bf16 anywhere, fp16 off the CPU), else nothing.  (accelerate's own
        would autocast to the device's default dtype under MEGATRON_LM -- fp16 on a GPU for bf16.)
        The engine runs its own mixed precision: `model(**batch)` inside gives the same numbers as outside."""
        if not self.megatron:
            with super().autocast(autocast_handler):
                yield
            return
        handler = autocast_handler if autocast_handler is not None else self.autocast_handler
        kwargs = handler.to_kwargs() if handler is not None else {}
        if not self.native_amp:
            context = contextlib.nullcontext()
        else:
            dtype = torch.float16 if self.mixed_precision == "fp16" else torch.bfloat16
            context = torch.autocast(device_type=self.device.type, dtype=dtype, **kwargs)
        with context:
            yield

    def _main_rank(self) -> int:
        return self.num_processes - 1  # accelerate's Megatron-LM main process: the last rank

    # ------------------------------------------------------------------ processes
    def wait_for_everyone(self):
        if not self.megatron:
            return super().wait_for_everyone()
        _barrier()  # accelerate's own wait_for_everyone skips MEGATRON_LM

    @contextlib.contextmanager
    def main_process_first(self):
        if not self.megatron:
            with super().main_process_first():
                yield
            return
        with self._goes_first(self.is_main_process):
            yield

    @contextlib.contextmanager
    def local_main_process_first(self):
        if not self.megatron:
            with super().local_main_process_first():
                yield
            return
        with self._goes_first(self.is_local_main_process):
            yield

    @contextlib.contextmanager
    def _goes_first(self, first: bool):
        if not first:
            _barrier()
        yield
        if first:
            _barrier()

    # ------------------------------------------------------------------ metrics over the dp group (metrics.py)
    def gather(self, tensor):
        if not self.megatron:
            return super().gather(tensor)
        return metrics.gather(tensor)

    def gather_for_metrics(self, input_data, use_gather_object: bool = False):
        """accelerate's gather_for_metrics over the data-parallel group: the duplicates that
        even_batches added to the last batch are dropped (`gradient_state.remainder`)."""
        if not self.megatron:
            return super().gather_for_metrics(input_data, use_gather_object)
        return metrics.gather_for_metrics(input_data, use_gather_object, self.gradient_state)

    def reduce(self, tensor, reduction="sum", scale=1.0):
        """accelerate's reduce ("sum", "mean" or "max") over the data-parallel group; `scale` is ignored,
        as accelerate's own applies it on XLA only."""
        if not self.megatron:
            return super().reduce(tensor, reduction, scale)
        return metrics.reduce(tensor, reduction)

    # ------------------------------------------------------------------ weights
    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        """Under Megatron-LM: a transformers model holding the current full weights, on every rank
        (a collective: every rank calls it; memory: one full copy per rank, on CPU)."""
        if not (self.megatron and isinstance(model, MegatronEngine)):
            return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)
        chunks = list(model.chunks)
        return transformers_model(gather_full(chunks, dst=None, optimizer=model.optimizer), chunks[0].config, model.hf_config)

    def get_state_dict(self, model, unwrap: bool = True):
        """Under Megatron-LM: the full state dict under transformers' names on the main process
        ({} elsewhere); every rank calls it."""
        if not (self.megatron and isinstance(model, MegatronEngine)):
            return super().get_state_dict(model, unwrap)
        chunks = list(model.chunks)
        full = gather_full(chunks, dst=self._main_rank(), optimizer=model.optimizer)
        return hf_state_dict(full, chunks[0].config) if full is not None else {}

    def save_model(self, model, save_directory, max_shard_size="10GB", safe_serialization: bool = True):
        """Under Megatron-LM: a transformers folder (weights + config.json) that
        `AutoModelForCausalLM.from_pretrained` loads; every rank calls it, the main process writes."""
        if not (self.megatron and isinstance(model, MegatronEngine)):
            return super().save_model(model, save_directory, max_shard_size, safe_serialization)
        if not safe_serialization:
            raise ConfigError("accelerator.save_model(safe_serialization=False) is not supported under Megatron-LM; "
                              "it writes safetensors")
        chunks = list(model.chunks)
        full = gather_full(chunks, dst=self._main_rank(), optimizer=model.optimizer)
        if full is not None:
            write_hf_folder(full, chunks[0].config, save_directory, max_shard_size)
        _barrier()

    # ------------------------------------------------------------------ state
    def save_state(self, output_dir=None, safe_serialization: bool = True, **save_model_func_kwargs):
        if not self.megatron:
            return super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
        return state_io.save_state(self, self._need_engine("save_state"), output_dir)

    def load_state(self, input_dir=None, load_kwargs=None, **load_model_func_kwargs):
        if not self.megatron:
            return super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        return state_io.load_state(self, self._need_engine("load_state"), input_dir)

    def free_memory(self, *objects):
        if self.megatron:
            self._engine, self._pending = None, []
        return super().free_memory(*objects)

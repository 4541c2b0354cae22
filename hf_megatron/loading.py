"""Build this rank's model: plain GPTModel on meta -> pipeline chunk -> TP -> compile -> recompute -> weights.

    with torch.device("meta"):
        whole = GPTModel(config, dtype)                             # full shapes, no memory
    chunk = split_module(whole, index, pp * vpp, layers_per_stage)   # this chunk's layers only
    parallelize(chunk, plan_for(config), tp_group, sequence_parallel)  # this rank's shards
    apply_float8(chunk, *fp8)                                         # if fp8=(format, recipe)
    apply_wgrad_fusion(chunk)                                         # if gradient_accumulation_fusion
    apply_compile(chunk)                                              # if compile=True: per layer
    apply_recompute(chunk, recompute)                                 # (checkpoint wraps compiled)
    chunk.to_empty(device=device); load weights                       # pretrained or Megatron init

Weights arrive as *full* megatron-core tensors (from a transformers checkpoint through the
architecture's mapping, from a Megatron checkpoint, or drawn by `model.init`), one at a time,
and each is cut to this rank's shard by the same plan that built the modules.

`hf_megatron.from_pretrained(source)` is this for one stage; `build_model_chunks` gives a
pipeline rank its (virtual) chunks.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from .architectures import hf_to_mcore, plan_for
from .config import ConfigError, ModelConfig
from .checkpoint.shapes import check_missing, check_tensor
from .conversion.hf_io import HFCheckpoint
from .conversion.layout import hf_shapes
from .model.gpt import GPTModel
from .model.init import init_tensor
from .parallel import state
from .parallel.compile import apply_compile
from .parallel.float8 import apply_float8, bf16_layer_numbers
from .parallel.linear_loss import apply_fused_linear_loss
from .parallel.parallelize import parallelize
from .parallel.pipeline import split_module
from .parallel.recompute import apply_recompute
from .parallel.sharding import load_full_weights
from .parallel.wgrad import apply_wgrad_fusion

_GRID = object()  # default tensor-parallel group: the one of the process's rank grid


def _hf_source(source: Any) -> tuple[ModelConfig, Callable[[str], torch.Tensor], torch.dtype]:
    """(config, get(name) -> tensor, dtype) for a transformers model object, a folder or a repo id;
    every weight the config needs is checked present at its shape before any is read.  `dtype`
    is what transformers' `from_pretrained(dtype="auto")` (its default) gives: config.json's
    `dtype` / `torch_dtype`, else the stored weights' -- for a model object, its weights'."""
    if isinstance(source, nn.Module) and hasattr(source, "config"):
        config = ModelConfig.from_hf(source.config.to_dict())
        state_dict = source.state_dict()
        expected = hf_shapes(config)
        check_missing("the given model", state_dict, expected, config, "its config")
        for name, shape in expected.items():
            check_tensor("the given model", name, state_dict[name].shape, state_dict[name].dtype, shape, config,
                         "its config")
        dtype = next((p.dtype for p in source.parameters() if p.is_floating_point()), torch.get_default_dtype())
        return config, lambda name: state_dict[name].detach(), dtype
    checkpoint = HFCheckpoint(source)
    config = checkpoint.model_config()
    checkpoint.check(config)
    return config, checkpoint.get, checkpoint.auto_dtype()


def init_pairs(model: nn.Module, full_shapes: dict[str, torch.Size], seed: int) -> Iterable[tuple[str, torch.Tensor]]:
    """Megatron-style initial full tensors (of `full_shapes`, the whole model's) for the parameters
    `model` holds; a tied output-layer copy is drawn as the embedding it copies."""
    config = model.config
    for name, _ in model.named_parameters():
        if name == "output_layer.weight" and config.tie_word_embeddings:
            name = "embedding.word_embeddings.weight"
        yield name, init_tensor(name, tuple(full_shapes[name]), config, seed)


PARAM_TAGS = ("tensor_parallel_dim", "sequence_parallel")  # set by parallelize, read by the optimizer


def materialise(model: nn.Module, device) -> None:
    """Allocate a meta-device model's tensors on `device` (values unset), keeping the parameter
    tags that `to_empty` would drop along with the old Parameter objects."""
    tags = {name: {t: getattr(p, t) for t in PARAM_TAGS if hasattr(p, t)} for name, p in model.named_parameters()}
    model.to_empty(device=device)
    for name, p in model.named_parameters():
        for tag, value in tags[name].items():
            setattr(p, tag, value)


def build_model(source: Any, *, stage: int = 0, num_stages: int = 1, layers_per_stage: list[int] | None = None,
                tp_group: Any = _GRID, sequence_parallel: bool = False, recompute: str | None = None,
                compile: bool | dict = False, dtype: torch.dtype | None = None, device=None, seed: int = 1234,
                init: bool = True, fused_loss: bool = False, fp8: tuple[str, str] | None = None,
                fp8_bf16_layers: tuple[int, int] = (0, 0), gradient_accumulation_fusion: bool = False) -> GPTModel:
    """Pipeline chunk `stage` of `num_stages` of the model, tensor-parallel over `tp_group`.

    `source`: a ModelConfig (fresh Megatron init from `seed`: the same weights in every layout;
    `init=False` leaves them unset, for a caller that fills them itself) or a transformers model /
    folder / Hub id (its pretrained weights).  `compile=True` (or a dict of `torch.compile` keywords,
    e.g. {"mode": "max-autotune-no-cudagraphs"}) compiles each transformer layer and the loss
    (`parallel.compile.apply_compile`), inside any recompute.  `fused_loss=True` computes the output
    layer and the cross entropy in chunks on the training path (`parallel.linear_loss`): no whole
    [tokens, vocab] logits.  `fp8=(format, recipe)`, e.g. ("hybrid", "tensorwise"): the layers'
    linears in torchao float8 (`parallel.float8`; CUDA only, tp 1), swapped in before compile;
    `fp8_bf16_layers=(N, M)` keeps the whole model's first N and last M layers in bf16.
    `gradient_accumulation_fusion=True` makes the transformer layers'
    linears accumulate their weight gradients into the optimizer's fp32 main grads inside the
    GEMM (`parallel.wgrad`).  `dtype=None`: torch's default dtype; "auto": the pretrained source's
    (as transformers' from_pretrained picks it)."""
    if isinstance(source, ModelConfig):
        config, get, source_dtype = source, None, torch.get_default_dtype()
    else:
        config, get, source_dtype = _hf_source(source)  # opened once: config now, tensors after materialising
    if isinstance(dtype, str):
        if dtype != "auto":
            raise ConfigError(f"dtype: expected a torch.dtype or 'auto', got {dtype!r}")
        dtype = source_dtype
    with torch.device("meta"):
        whole = GPTModel(config, dtype=dtype)
    shapes = {k: v.shape for k, v in whole.state_dict().items()}  # before parallelize shards `whole` itself
    model = split_module(whole, stage, num_stages, layers_per_stage) if num_stages > 1 else whole
    if model.output_layer is not None and model.output_layer.weight is None and model.embedding is None:
        # tied embeddings on a last stage without the embedding: it holds its own copy, kept equal
        # to the first stage's by the pipeline's embedding-group gradient all-reduce (as Megatron)
        model.output_layer.weight = nn.Parameter(torch.empty_like(whole.embedding.word_embeddings.weight))
    parallelize(model, plan_for(config), state.tp_group() if tp_group is _GRID else tp_group, sequence_parallel)
    if fused_loss and model.post_process:
        apply_fused_linear_loss(model)  # output layer + loss in chunks (parallel/linear_loss.py)
    if fp8 is not None:  # on meta, before materialising: a bad setup fails before any weight is read
        apply_float8(model, *fp8, device=device or "cpu",
                     bf16_layers=bf16_layer_numbers(config.num_layers, *fp8_bf16_layers))
    if gradient_accumulation_fusion:
        apply_wgrad_fusion(model)  # after float8 (its linears stay unfused), before compile
    if compile:
        # before recompute: the checkpoint must wrap the compiled layer (see parallel/compile.py)
        apply_compile(model, **(compile if isinstance(compile, dict) else {}))
    apply_recompute(model, recompute)
    materialise(model, device or "cpu")
    if get is not None:
        load_full_weights(model, hf_to_mcore(get, config, model.layer_numbers))
    elif init:
        load_full_weights(model, init_pairs(model, shapes, seed))
    model.activation_dtype = dtype or torch.get_default_dtype()  # what flows between pipeline stages
    return model


def from_pretrained(name_or_path_or_model: Any, *, dtype: torch.dtype | str | None = "auto", device=None,
                    **kwargs: Any) -> GPTModel:
    """A GPTModel with the pretrained weights of a transformers causal LM (object, folder or Hub id),
    returned as transformers' `from_pretrained` returns its model: in eval mode (dropout off; call
    `.train()` to train) and, by default (`dtype="auto"`), in config.json's `dtype` (else the stored
    weights'); `dtype=torch.float32` (or None: torch's default) asks for another.

    Keyword arguments go to `build_model` (`sequence_parallel`, `recompute`, `compile`, `tp_group`, `stage`,
    `num_stages`, `layers_per_stage`).  After `hf_megatron.parallel.initialize(tp=...)` the model is
    tensor-parallel over the process grid's TP group and each rank loads only its shard."""
    return build_model(name_or_path_or_model, dtype=dtype, device=device, **kwargs).eval()


def build_model_chunks(source: Any, *, vpp: int = 1, layers_per_stage: list[int] | None = None,
                       **kwargs: Any) -> list[GPTModel]:
    """This pipeline rank's model chunks: chunk v is model chunk v * pp + pp_rank of pp * vpp
    (Megatron's interleaved assignment).  Keyword arguments go to `build_model`."""
    if vpp < 1:
        raise ValueError(f"virtual pipeline size must be >= 1, got {vpp}")
    grid = state.get_state()
    pp, pp_rank = grid.pp, grid.coords["pp"]
    if vpp > 1 and pp == 1:
        raise ValueError(f"virtual pipeline size {vpp} needs pipeline_model_parallel_size > 1")
    return [build_model(source, stage=v * pp + pp_rank, num_stages=pp * vpp, layers_per_stage=layers_per_stage,
                        **kwargs) for v in range(vpp)]

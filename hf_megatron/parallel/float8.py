"""float8 training of the plain model's linears, applied from outside (like tensor parallelism).

    chunks = build_model(source, cfg)          # cfg.fp8_format set: built with float8 linears
    # = parallelize(...); apply_float8(chunk, "hybrid", "tensorwise"); apply_compile(chunk)

torchao's float8 training replaces each selected nn.Linear by a Float8Linear that, for
Y = X W^T, computes  Y ~= (X / s_x)_f8 (W / s_w)_f8^T * s_x s_w  with `torch._scaled_mm`, and the
two backward GEMMs likewise with the output gradient G cast to float8; each scale is dynamic,
s = amax / (largest finite value of the float8 type), from the current tensor.  The weight stays
a bf16 parameter, so the fp32 main-weight optimizer, its main-grad hooks and the checkpoint names
are untouched.  Megatron-LM's flags, mapped onto what torchao does:

  --fp8-format hybrid   X, W in e4m3 (3 mantissa bits, max 448), G in e5m2 (2 bits, max 57344):
                        gradients have the wider range (Transformer Engine's Format.HYBRID)
  --fp8-format e4m3     X, W and G all in e4m3
  --fp8-recipe tensorwise   one scale per tensor (cuBLAS tensorwise kernel; torchao's fastest)
  --fp8-recipe rowwise      one scale per row of each operand (CUTLASS rowwise kernel, scales
                            rounded down to powers of two); torchao casts G to e4m3 here, so only
                            with --fp8-format e4m3
  --fp8-recipe rowwise_with_gw_hp   rowwise, but the weight-gradient GEMM (dW = G^T X) stays in bf16
                            (torchao's and torchtitan's name; e4m3 only): the GEMM whose float8
                            rounding the optimizer sees directly is exact
Megatron-LM's `delayed`, `mxfp8` and `blockwise` recipes are Transformer Engine's; torchao has none
of them.

Kept in bf16, as Megatron-LM keeps it: the output layer (the vocabulary projection feeds the
loss; it is 21% of the Llama 1.2B's matmul FLOPs with its 128k vocabulary, 12% of the 3B's, ~7% of
an 8B's), any linear whose dimensions are not multiples of 16
(`_scaled_mm`'s rule), and the layers named in `bf16_layers` -- Megatron-LM's
`--first-last-layers-bf16` with `--num-layers-at-start-in-bf16 N` / `--num-layers-at-end-in-bf16 M`
(default 1 each): the first N and last M transformer layers of the whole model, where the
activations' ranges are widest (embedding outputs, the last layers feeding the logits).  Needs CUDA with float8 tensor cores (sm89+, e.g. H100/H200), bf16 and
torchao importable; otherwise one clear error.  Tensor parallelism: torchao's swap builds a fresh
Float8Linear from the weight alone, which would drop the Column/RowParallelLinear collectives (and
its filter skips them), so float8 is refused at tp > 1.
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError
from . import comm

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def check_fp8_choice(fp8_format: str, recipe: str) -> None:
    """The (format, recipe) pairs torchao can run (one-line ConfigError otherwise)."""
    if fp8_format not in FP8_FORMATS or recipe not in FP8_RECIPES:
        raise ConfigError(f"--fp8-format / --fp8-recipe: expected a format in {FP8_FORMATS} and a recipe in "
                          f"{FP8_RECIPES}, got {fp8_format!r} / {recipe!r}")
    if recipe.startswith("rowwise") and fp8_format == "hybrid":
        raise ConfigError(f"--fp8-recipe {recipe}: torchao's rowwise recipes cast gradients to e4m3 as well; use "
                          "--fp8-format e4m3 with it (hybrid e5m2 gradients need --fp8-recipe tensorwise)")


def _eligible(module: nn.Module, name: str, bf16_layers=frozenset()) -> bool:
    if type(module) is not nn.Linear or name.endswith("output_layer"):
        return False
    parts = name.split(".")  # decoder.layers.<global number>.<...>
    if len(parts) > 2 and parts[:2] == ["decoder", "layers"] and int(parts[2]) in bf16_layers:
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def bf16_layer_numbers(num_layers: int, at_start: int, at_end: int) -> frozenset[int]:
    """Global numbers of the first `at_start` and last `at_end` of `num_layers` layers."""
    if at_start < 0 or at_end < 0:
        raise ConfigError(f"--num-layers-at-start-in-bf16 / --num-layers-at-end-in-bf16: expected >= 0, got "
                          f"{at_start} / {at_end}")
    return frozenset(range(min(at_start, num_layers))) | frozenset(range(max(num_layers - at_end, 0), num_layers))


def check_float8_runs(device=None) -> None:
    """One-line ConfigError unless float8 training can run here: a CUDA device (`device`, when given,
    must be one) with compute capability 8.9+ and torchao importable."""
    if device is not None and torch.device(device).type != "cuda":
        raise ConfigError(f"--fp8-format: float8 training needs the model on a CUDA GPU, got device "
                          f"{torch.device(device).type}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise ConfigError("--fp8-format: float8 needs a CUDA GPU with float8 tensor cores (compute capability "
                          "8.9+, e.g. H100/H200); none is available")
    try:
        import torchao.float8  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"--fp8-format: float8 training needs torchao, which is not importable ({exc}); "
                          "pip install torchao") from None


def torchao_config(fp8_format: str = "hybrid", recipe: str = "tensorwise"):
    """torchao's Float8LinearConfig for Megatron-LM's (--fp8-format, --fp8-recipe)."""
    check_fp8_choice(fp8_format, recipe)
    from torchao.float8 import CastConfig, Float8LinearConfig
    from torchao.float8.config import e4m3_dtype
    config = Float8LinearConfig.from_recipe_name(recipe)  # tensorwise: e4m3 X, W; e5m2 G (= hybrid)
    if recipe == "tensorwise" and fp8_format == "e4m3":
        config = Float8LinearConfig(cast_config_grad_output=CastConfig(target_dtype=e4m3_dtype))
    return config


def apply_float8(model: nn.Module, fp8_format: str = "hybrid", recipe: str = "tensorwise",
                 device=None, bf16_layers=frozenset()) -> nn.Module:
    """Swap the eligible nn.Linear modules of `model` for torchao Float8Linear, in place (on the meta
    device or materialised alike; parameter objects and names are kept).  Apply after
    `parallelize` and before `apply_compile`: float8 pays only compiled (the scaling fuses into the
    casts).  `device`: where the model will run, checked to be CUDA.  `bf16_layers`: global layer
    numbers whose linears stay bf16 (see `bf16_layer_numbers`)."""
    check_fp8_choice(fp8_format, recipe)
    if comm.group_size(getattr(model, "tp_group", None)) > 1:
        raise ConfigError("--fp8-format: float8 training is not supported with tensor parallelism (torchao's "
                          "Float8Linear has no Column/RowParallelLinear version); use "
                          "--tensor-model-parallel-size 1")
    check_float8_runs(device)
    from torchao.float8 import convert_to_float8_training
    convert_to_float8_training(model, config=torchao_config(fp8_format, recipe),
                               module_filter_fn=lambda module, name: _eligible(module, name, bf16_layers))
    return model

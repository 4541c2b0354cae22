"""float8 training of the plain model's linears, applied from outside (like tensor parallelism).

    chunks = build_model(source, cfg)          # bf16 weights, fp32 main weights in the optimizer
    apply_float8(chunk)                        # nn.Linear -> torchao Float8Linear, names unchanged
    apply_compile(chunk)                       # float8 pays only compiled (scaling fuses into the casts)

torchao's float8 training ("tensorwise" recipe by default: one dynamic scale per tensor,
amax / 448 for e4m3 activations and weights, e5m2 for gradients) replaces each selected
nn.Linear by a Float8Linear that casts input, weight and output gradient to float8 around
`torch._scaled_mm`; the weight stays a bf16 parameter, so the fp32 main-weight optimizer, its
main-grad hooks and the checkpoint names are untouched.  Skipped (kept in bf16): the output
layer (the vocabulary projection feeds the loss; float8 logits cost accuracy for ~5% of the
FLOPs), and any linear whose dimensions are not multiples of 16 (`_scaled_mm`'s rule).

Needs CUDA with float8 tensor cores (sm89+, e.g. H100/H200) and torchao importable; otherwise
one clear error.  Tensor-parallel layers are subclasses of nn.Linear but hold a process group;
torchao's Float8Linear does not know them, so float8 is refused at tp > 1.
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError


def _eligible(module: nn.Module, name: str) -> bool:
    return (type(module) is nn.Linear and not name.endswith("output_layer")
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def apply_float8(model: nn.Module, recipe: str = "tensorwise") -> nn.Module:
    """Swap the eligible nn.Linear modules of `model` for torchao Float8Linear, in place."""
    if any(type(m) is not nn.Linear and isinstance(m, nn.Linear) for m in model.modules()):
        raise ConfigError("float8: tensor-parallel linears are not supported; use float8 at "
                          "tensor_model_parallel_size 1")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise ConfigError("float8: needs a CUDA GPU with float8 tensor cores (compute capability 8.9+)")
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as exc:
        raise ConfigError(f"float8: torchao is not importable ({exc}); pip install torchao") from None
    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: _eligible(m, fqn))
    return model

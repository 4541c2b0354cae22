"""What an accelerate user sees when the input is wrong: one line naming the accelerate config field.

* `check_world` / `check_model_fits`: the layout against the world size and the model, in the
  names of the accelerate config file (`num_processes`, `megatron_lm_tp_degree`,
  `megatron_lm_pp_degree`) and of the model's own config.json (GPT-2's `n_head`, Llama's
  `num_key_value_heads`), before the library's checks (which speak Megatron's names) are reached.
* `install_excepthook`: a project error (`HFMegatronError`: a bad input) that leaves the script
  is printed as one line `<script>: error: <message>` on each rank that raised it, as the CLI
  does; any other exception (our bug, or the script's) keeps its traceback.
* `check_plugin_numbers`: accelerate's MegatronLMPlugin reads the config file's numbers from
  MEGATRON_LM_* variables in `__post_init__` (`int("two")`: a traceback per rank); checked first,
  one line naming the field.
* `refuse_dummy_data_loader`: accelerate's `MegatronLMDummyDataLoader` needs NVIDIA's
  Megatron-LM to even be built (without it its constructor fails on a NameError); it becomes a
  one-line error saying what to use instead.
"""
from __future__ import annotations

import os
import sys

from ...errors import ConfigError, HFMegatronError, ParallelConfigError

TP, PP = "megatron_lm_tp_degree", "megatron_lm_pp_degree"


def check_world(world: int, tp: int, pp: int) -> None:
    if world % (tp * pp):
        raise ParallelConfigError(
            f"accelerate config: num_processes={world} is not a multiple of {TP} ({tp}) x {PP} ({pp}) = {tp * pp}; "
            f"num_processes must be {TP} x {PP} x the data-parallel size")


def _hf_name(hf_config, name: str) -> str:
    """transformers' standard field name, with this model's config.json spelling (GPT-2: n_head)."""
    alias = getattr(hf_config, "attribute_map", {}).get(name)
    return f"{name} ({alias})" if alias and alias != name else name


def check_model_fits(model_config, hf_config, tp: int, pp: int, vpp: int) -> None:
    """model_config: our ModelConfig of the prepared model; hf_config: its transformers config."""
    kv_field = "num_key_value_heads" if getattr(hf_config, "num_key_value_heads", None) else "num_attention_heads"
    if model_config.num_query_groups % tp:
        raise ParallelConfigError(
            f"accelerator.prepare(model): {TP}={tp} does not divide the model's {_hf_name(hf_config, kv_field)}="
            f"{model_config.num_query_groups} (each tensor-parallel rank holds whole heads); use a {TP} that divides it")
    if model_config.ffn_hidden_size % tp:
        raise ParallelConfigError(
            f"accelerator.prepare(model): {TP}={tp} does not divide the model's MLP width (intermediate_size)="
            f"{model_config.ffn_hidden_size}; use a {TP} that divides it")
    stages = pp * vpp
    if model_config.num_layers % stages:
        across = f"{PP}={pp}" + (f" x virtual_pipeline_model_parallel_size={vpp}" if vpp > 1 else "")
        raise ParallelConfigError(
            f"accelerator.prepare(model): the model's {_hf_name(hf_config, 'num_hidden_layers')}="
            f"{model_config.num_layers} is not divisible by {across}; every pipeline stage holds as many layers")


_installed = False


def install_excepthook() -> None:
    """Print an uncaught HFMegatronError as one line (module docstring); idempotent."""
    global _installed
    if _installed:
        return
    previous = sys.excepthook

    def hook(kind, value, traceback):
        if isinstance(value, HFMegatronError):
            script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
            print(f"{script}: error: {value}", file=sys.stderr, flush=True)
            return
        previous(kind, value, traceback)

    sys.excepthook = hook
    _installed = True


def refuse_dummy_data_loader() -> None:
    from accelerate.utils import megatron_lm
    loader = getattr(megatron_lm, "MegatronLMDummyDataLoader", None)
    if loader is None or hasattr(megatron_lm, "_add_data_args") or getattr(loader, "_hf_megatron", False):
        return  # NVIDIA's Megatron-LM is installed: accelerate's class works (our Accelerator refuses it)

    def __init__(self, **dataset_kwargs):
        raise ConfigError("MegatronLMDummyDataLoader needs NVIDIA's Megatron-LM, which hf_megatron replaces; build "
                          "the datasets with hf_megatron.data.build_gpt_datasets (Megatron's .bin/.idx) and pass a "
                          "torch DataLoader (batch_size = micro batch size) to accelerator.prepare")

    loader.__init__ = __init__
    loader._hf_megatron = True


_PLUGIN_NUMBERS = {"tp_degree": int, "pp_degree": int, "num_micro_batches": int, "gradient_clipping": float}


def check_plugin_numbers() -> None:
    """MegatronLMPlugin.__post_init__ first checks the numbers `accelerate launch` passes it (module docstring)."""
    from accelerate.utils import MegatronLMPlugin
    if getattr(MegatronLMPlugin, "_hf_megatron", False):
        return
    post_init = MegatronLMPlugin.__post_init__

    def __post_init__(self):
        for field, kind in _PLUGIN_NUMBERS.items():
            value = os.environ.get(f"MEGATRON_LM_{field.upper()}")
            if getattr(self, field, None) is None and value is not None:
                try:
                    kind(value)
                except ValueError:
                    raise ConfigError(f"accelerate config: megatron_lm_{field}={value!r}: expected "
                                      f"{'an integer' if kind is int else 'a number'}") from None
        post_init(self)

    MegatronLMPlugin.__post_init__ = __post_init__
    MegatronLMPlugin._hf_megatron = True

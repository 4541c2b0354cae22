"""Megatron-LM's own training package (a checkout at tag core_v0.16.1) on CPU, for the tests.

`HF_MEGATRON_MEGATRON_LM` names the checkout (the folder holding `megatron/training`); without it
the tests that use this module are skipped (CI has no network and no checkout).

How the two halves of `megatron` are combined: `megatron` has no `__init__.py` in either the
megatron-core 0.16.1 wheel or the checkout, so it is a namespace package whose `__path__` is
every `megatron/` folder on sys.path, in sys.path order.  The checkout is APPENDED to sys.path,
so `megatron.core` keeps resolving to the wheel's (site-packages comes first) and
`megatron.training`, `megatron.legacy` (absent from the wheel) come from the checkout.
`import_megatron_lm` checks both: the wheel's `megatron.core` is the one imported, and its
version equals the checkout's `megatron/core/package_info.py` (at core_v0.16.1 the two trees'
Python sources are identical; only READMEs differ).

Shims, each installed only where the real import fails, none touching checkpoint code:
* `six`: `megatron/training/tokenizer/bert_tokenization.py` imports it (Python 2 compatibility;
  not in Megatron-LM's declared dependencies): a module with PY2 = False, PY3 = True.
* `megatron.core.transformer.custom_layers.batch_invariant_kernels`: imports triton at module
  level (no triton on CPU builds of torch); `megatron/training/initialize.py` imports
  `enable_batch_invariant_mode` from it, called only with --batch-invariant-mode: a module whose
  `enable_batch_invariant_mode` raises.
* `cuda_calls_on_cpu()` (around Megatron-LM's save_checkpoint / load_checkpoint only): its
  `get_rng_state` stores `torch.cuda.get_rng_state()`, which needs CUDA; the CPU generator's state
  stands in for it (torch.cuda.set_rng_state on a CPU build queues the call and never runs it, so
  loading needs nothing); megatron-core's torch_dist writer calls `torch.cuda.synchronize()`
  before writing (nothing to wait for on CPU): a no-op.
Megatron-LM's global state is set by its own `set_global_variables(args, build_tokenizer=False)`
after its own `parse_args` + `load_args_from_checkpoint` + `validate_args` (what its
tools/checkpoint loaders do); the tokenizer is not built (padded_vocab_size comes from the
checkpoint's args, as in those loaders).  megatron-core's CUDA-only scalar bookkeeping is run
under tests/test_megatron_optimizer.py's `megatron_core_on_cpu`.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import types
from pathlib import Path

import pytest
import torch

MEGATRON_LM = os.environ.get("HF_MEGATRON_MEGATRON_LM")
requires_megatron_lm = pytest.mark.skipif(
    not MEGATRON_LM, reason="HF_MEGATRON_MEGATRON_LM is unset: set it to a Megatron-LM checkout at tag core_v0.16.1 "
                            "(the folder holding megatron/training); CI has none")

BATCH_INVARIANT = "megatron.core.transformer.custom_layers.batch_invariant_kernels"


def _install_missing(name: str, make) -> None:
    try:
        __import__(name)
    except ImportError:
        sys.modules[name] = make()


def _six() -> types.ModuleType:
    six = types.ModuleType("six")
    six.PY2, six.PY3 = False, True
    return six


def _no_batch_invariant_kernels() -> types.ModuleType:
    module = types.ModuleType(BATCH_INVARIANT)

    def enable_batch_invariant_mode(*args, **kwargs):
        raise RuntimeError("batch-invariant mode needs triton (not installed): test shim")
    module.enable_batch_invariant_mode = enable_batch_invariant_mode
    return module


def import_megatron_lm(tree: str | None = None) -> types.ModuleType:
    """Megatron-LM's `megatron.training.checkpointing` from the checkout over the wheel's
    megatron-core (see the module docstring); idempotent."""
    tree = Path(tree or MEGATRON_LM).absolute()
    if not (tree / "megatron" / "training" / "checkpointing.py").is_file():
        raise FileNotFoundError(f"{tree}: no megatron/training/checkpointing.py (HF_MEGATRON_MEGATRON_LM)")
    import megatron.core
    from megatron.core import package_info
    wheel = Path(megatron.core.__file__).parent
    assert tree not in wheel.parents, f"megatron.core was imported from the checkout ({wheel}), not the wheel"
    theirs = dict(re.findall(r"^(MAJOR|MINOR|PATCH) = (\d+)", (tree / "megatron/core/package_info.py").read_text(), re.M))
    assert (package_info.MAJOR, package_info.MINOR, package_info.PATCH) == \
        tuple(int(theirs[k]) for k in ("MAJOR", "MINOR", "PATCH")), "checkout's megatron-core differs from the wheel's"
    if str(tree) not in sys.path:
        sys.path.append(str(tree))  # after site-packages: megatron.core stays the wheel's
    _install_missing("six", _six)
    _install_missing(BATCH_INVARIANT, _no_batch_invariant_kernels)
    from megatron.training import checkpointing
    assert Path(checkpointing.__file__).is_relative_to(tree)
    assert Path(sys.modules["megatron.core"].__file__).parent == wheel
    return checkpointing


# what Megatron-LM's own tools/checkpoint loaders pass for a CPU run, and the CPU switches
# tests/test_megatron_interop.py's mcore_model_from_args sets (no fusions, CPU init, no dropout)
CPU_FLAGS = ["--use-cpu-initialization", "--transformer-impl", "local", "--no-masked-softmax-fusion",
             "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
             "--no-gradient-accumulation-fusion", "--no-one-logger"]


def megatron_lm_args(flags: list, checkpoint_args_from: Path | None = None):
    """Megatron-LM's args for `pretrain_gpt.py <flags>`: its parse_args, then (when given) its
    load_args_from_checkpoint from the checkpoint folder `checkpoint_args_from` (model shape,
    positions, norms, biases, padded vocab), its validate_args, and its set_global_variables."""
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.checkpointing import load_args_from_checkpoint
    argv = sys.argv
    sys.argv = ["pretrain_gpt.py", *map(str, flags), *CPU_FLAGS]
    try:
        args = parse_args()
    finally:
        sys.argv = argv
    if checkpoint_args_from is not None:
        load, args.load = args.load, str(checkpoint_args_from)
        with megatron_lm_on_cpu():
            args, _ = load_args_from_checkpoint(args)
        args.load = load
    args = validate_args(args)
    global_vars.unset_global_variables()
    global_vars.set_global_variables(args, build_tokenizer=False)
    return args


@contextlib.contextmanager
def cuda_calls_on_cpu():
    """torch.cuda.get_rng_state -> the CPU generator's state, torch.cuda.synchronize -> nothing
    (see the module docstring)."""
    real = torch.cuda.get_rng_state, torch.cuda.synchronize
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.synchronize = lambda device=None: None
    try:
        yield
    finally:
        torch.cuda.get_rng_state, torch.cuda.synchronize = real


@contextlib.contextmanager
def megatron_lm_on_cpu():
    """megatron_core_on_cpu (device='cuda' scalars, e.g. read_metadata's all-reduced iteration)
    plus cuda_calls_on_cpu."""
    from test_megatron_optimizer import megatron_core_on_cpu
    with megatron_core_on_cpu(), cuda_calls_on_cpu():
        yield


def megatron_lm_model(args):
    """Megatron-LM's model: its gpt_builder (core_transformer_config_from_args, the local layer
    spec, megatron-core's GPTModel), wrapped in Float16Module for fp16 / bf16 as its get_model does."""
    from megatron.core.transformer.module import Float16Module
    from gpt_builders import gpt_builder
    model = gpt_builder(args, pre_process=True, post_process=True)
    return Float16Module(model.config, model) if args.fp16 or args.bf16 else model


def megatron_lm_optimizer_and_scheduler(model, args):
    """Megatron-LM's optimizer for one model chunk: get_megatron_optimizer_config(args) and
    megatron-core's builder over `_get_param_groups` (what get_megatron_optimizer calls, without
    the DDP wrapper: grads in .grad), and its get_optimizer_param_scheduler."""
    from megatron.core import parallel_state
    from megatron.core.optimizer import _get_megatron_optimizer_based_on_param_groups, _get_param_groups
    from megatron.training.training import get_megatron_optimizer_config, get_optimizer_param_scheduler
    from test_megatron_optimizer import megatron_core_on_cpu
    config, overrides = get_megatron_optimizer_config(args)
    with megatron_core_on_cpu():
        optimizer = _get_megatron_optimizer_based_on_param_groups(
            config, [model], _get_param_groups([model], config, overrides),
            model_parallel_group=parallel_state.get_model_parallel_group())
    return optimizer, get_optimizer_param_scheduler(optimizer)

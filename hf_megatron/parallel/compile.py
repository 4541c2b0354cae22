"""Regional torch.compile applied from outside: each transformer layer (and the loss) compiled.

    parallelize(model, plan, tp_group)   # TP modules swapped in first
    apply_compile(model)                 # then compile: layer.forward = torch.compile(layer.forward)
    apply_recompute(model, "full")       # then recompute: the checkpoint wraps the *compiled* layer

Why per layer: all layers run the same code, so dynamo compiles one graph and every layer reuses
it (guards on shapes, not on the module), so compile time does not grow with depth, and the
embedding / pipeline plumbing stays eager.  The vocab loss is a region of its own: compiled, the
fp32 upcast of the [s, b, V] logits and the cross entropy fuse instead of materialising an fp32
copy of the logits (on a CUDA GPU with the csrc kernels, the region calls the csrc cross entropy
instead, kept out of the graph: kernels/cross_entropy.py, faster than inductor's fusion).  Forwards
are replaced on the instance (as recompute does), so parameter and state-dict names do not change.
Inside a compiled region the RMSNorm and rotary csrc kernels fall back to their PyTorch expressions
(`kernels._compiling`), which inductor fuses itself; SwiGLU stays the csrc kernel (a torch.library
custom op, kernels/ops.py).

Scope "decoder" (`--torch-compile-scope decoder`): the decoder stack of this model chunk -- all its
layers and the final norm -- is one region instead (dynamo unrolls the layer loop).  Longer compile
(the graph grows with depth), but one compiled call per forward and per backward instead of one per
layer (each costs guard checks and AOTAutograd's wrappers on the host: the step of a small model on
a GPU is host-bound), and inductor may fuse across layer boundaries (a layer's last residual add
with the next layer's norm).  Not with activation recompute: its checkpoint around each layer would
be traced inside the region, where its replay counter graph-breaks (see below).

Order with recompute (checked by tests/test_compile.py):
* compile first, recompute second.  `recompute` wraps the layer's forward in
  `checkpoint(replayable(forward))`; `replayable` keeps a call counter (it replays the TP dropout
  stream on recomputation), a Python side effect that dynamo refuses inside a checkpoint, so a
  layer compiled *after* full recompute graph-breaks at the checkpoint and runs entirely eager.
  Compiled first, the eager checkpoint calls the compiled forward, and its recomputation in
  backward replays the same compiled graph (same saved tensors, same numbers).
  `apply_compile` raises if a layer is already recomputed.
* "selective" recompute (core attention only) applied after compile: dynamo graph-breaks around
  the checkpointed core attention (three compiled pieces per layer, attention itself eager under
  the checkpoint).  Correct, a little less fused; with SDPA's flash/efficient kernels core
  attention saves no s x s activations anyway, so under compile prefer no recompute or "full".

Memory budget (`--activation-memory-budget B`, 0 < B < 1; torchtitan's `memory_budget` mode): each
region runs with torch's `torch._functorch.config.activation_memory_budget` = B (read when its first
call compiles and partitions the graph), so
AOTAutograd's partitioner saves at most about B of the activations its default choice keeps and
recomputes the cheapest of the rest in backward (pointwise and norm passes first), instead of a
checkpoint of whole layers.  The config is set only around the region's calls: other compiled code
in the process keeps torch's default.  (Dynamo caches a layer's graph per code object, so in one
process the first model to compile a layer decides its budget for later models of the same class.)

Tensor parallelism: the collectives of `parallel.comm` (autograd Functions around
torch.distributed calls) trace into the graph without a break.  The tensor-parallel RNG fork
(`random.tp_rng`, around core attention and, with sequence parallelism, around dropouts) reads and
sets generator states, which dynamo does not trace: once the RNG streams are seeded
(`setup_parallel`), each fork is a graph break -- correct (checked against eager at tp=2, with and
without SP), just split into more compiled pieces.
"""
from __future__ import annotations

import functools
import warnings

import torch
import torch._dynamo.exc
import torch._functorch.config
from torch import nn

_COMPILED = "_hf_megatron_compiled"
_SCOPE = "_hf_megatron_compile_scope"
SCOPES = ("layer", "decoder")


def compile_scope(model: nn.Module) -> str | None:
    """The scope `apply_compile` compiled `model` with, or None (not compiled)."""
    return getattr(model, _SCOPE, None)


def _recomputed(module: nn.Module) -> bool:
    return getattr(module.forward, "hf_megatron_recompute", False)  # set by parallel/recompute.py


def compiled_regions(model: nn.Module, scope: str | None = None) -> list[tuple[str, nn.Module]]:
    """(name, module) of each region `apply_compile` compiles (or compiled, `scope` None: the scope
    it was given, else "layer"): `decoder.layers.N` or `decoder`, and the loss."""
    scope = scope or compile_scope(model) or "layer"
    regions = []
    for name, module in model.named_modules():
        per_layer = name.startswith("decoder.layers.") and name.count(".") == 2
        if (per_layer if scope == "layer" else name == "decoder") or name == "vocab_loss":
            regions.append((name, module))
    return regions


def _under_budget(forward, budget: float):
    """`forward` run with the partitioner's activation memory budget set to `budget` (and restored)."""
    config = torch._functorch.config

    @functools.wraps(forward)
    def run(*args, **kwargs):
        previous = config.activation_memory_budget
        config.activation_memory_budget = budget
        try:
            return forward(*args, **kwargs)
        finally:
            config.activation_memory_budget = previous

    return run


class EagerFallback:
    """Shared by the compiled regions of one model (`apply_compile(..., fallback=True)`): the first
    region whose compile fails (torch's BackendCompilerFailed: no C compiler for triton, a GPU too old
    for triton, ...) warns once and every region runs its eager forward from then on -- where compile
    is a default and not something the user asked for, a machine that cannot compile still trains."""

    def __init__(self) -> None:
        self.failed = False

    def guard(self, compiled, eager):
        """`compiled`, or `eager` once any region of this model failed to compile."""
        @functools.wraps(eager)
        def run(*args, **kwargs):
            if not self.failed:
                try:
                    return compiled(*args, **kwargs)
                except torch._dynamo.exc.BackendCompilerFailed as error:
                    self.failed = True
                    reason = str(error.inner_exception).strip().splitlines() or [type(error.inner_exception).__name__]
                    warnings.warn(f"hf_megatron: torch.compile failed here ({type(error.inner_exception).__name__}: "
                                  f"{reason[0][:200]}); the model runs eager from now on (--torch-compile shows the "
                                  "whole error, --no-torch-compile skips compiling)", stacklevel=2)
            return eager(*args, **kwargs)

        return run


def _kernels_loaded_first(forward):
    """`forward` (a compiled region), loading csrc/ eagerly before the first call that gets a CUDA
    tensor: the SwiGLU op inside the region asks for the extension, and a first load under dynamo's
    tracing (the build's file checks and hashing) would graph-break the region (kernels._kernel_ready
    then falls back to the PyTorch expression instead).  Once loaded (or failed) this is one check."""
    from .. import kernels

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not kernels.loaded() and kernels.enabled() and any(
                isinstance(a, torch.Tensor) and a.is_cuda for a in (*args, *kwargs.values())):
            kernels.load_extension()
        return forward(*args, **kwargs)

    return run


def apply_compile(model: nn.Module, mode: str | None = None, backend: str = "inductor", scope: str = "layer",
                  memory_budget: float | None = None, fallback: bool = False, **compile_kwargs) -> nn.Module:
    """Compile each transformer layer (`scope` "decoder": the whole decoder stack) and the vocab
    loss of `model` in place; returns model.

    `mode` and `backend` (and any other keyword) go to `torch.compile`; `memory_budget` (0 < B < 1,
    see the module docstring) to AOTAutograd's partitioner; `fallback`: a failed compile warns and
    runs eager (EagerFallback) instead of raising.  Apply after `parallelize` and before
    `apply_recompute` (see the module docstring); applying twice is a no-op."""
    if scope not in SCOPES:
        raise ValueError(f"apply_compile: scope should be one of {SCOPES}, got {scope!r}")
    if memory_budget is not None and not 0 < memory_budget < 1:
        raise ValueError(f"apply_compile: memory_budget should be > 0 and < 1, got {memory_budget!r}")
    if compile_scope(model) not in (None, scope):
        raise ValueError(f"apply_compile: already compiled with scope {compile_scope(model)!r}")
    if scope == "decoder" and any(_recomputed(m) for m in model.modules()):
        raise ValueError("apply_compile: scope 'decoder' with activation recompute applied; compile per layer "
                         "to recompute (the checkpoints would be traced inside the region)")
    setattr(model, _SCOPE, scope)
    guard = EagerFallback() if fallback else None
    for name, module in compiled_regions(model, scope):
        if getattr(module, _COMPILED, False):
            continue
        if _recomputed(module):  # recompute's checkpoint around the forward
            raise ValueError(f"apply_compile: {name} already has activation recompute; apply_compile first, "
                             "then apply_recompute (the checkpoint must wrap the compiled forward)")
        eager = module.forward
        module.forward = _kernels_loaded_first(torch.compile(eager, mode=mode, backend=backend, **compile_kwargs))
        if memory_budget is not None:
            module.forward = _under_budget(module.forward, memory_budget)
        if guard is not None:
            module.forward = guard.guard(module.forward, eager)
        if hasattr(module, "compile_chunks"):  # the fused output layer + loss (parallel/linear_loss.py)
            module.compile_chunks(guard, mode=mode, backend=backend, **compile_kwargs)
        setattr(module, _COMPILED, True)
    return model

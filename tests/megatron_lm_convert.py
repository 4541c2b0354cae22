"""Run Megatron-LM's tools/checkpoint/convert.py (checkout at HF_MEGATRON_MEGATRON_LM, tag
core_v0.16.1) on CPU:  python tests/megatron_lm_convert.py <convert.py's arguments>

At core_v0.16.1 `convert.py --loader core --saver core` fails on ANY checkpoint before it reads a
tensor, on any machine (not our files: the same happens with Megatron-LM's own checkpoints).
Workarounds for those upstream faults, each the smallest that lets its own code go on:

1. tools/checkpoint/loader_core.py:61 `import_model_provider` returns the bare `model_provider`
   instead of the `partial(model_provider, gpt_builder)` it stored at line 60; loader_base.py:208
   calls the returned function: `TypeError: model_provider() missing 1 required positional
   argument: 'model_builder'`.  Here it returns the stored partial.
2. Neither the loader nor the saver initialises megatron-core's parallel state (they install fake
   TP / EP groups only, loader_base.py:151-154, saver_base.py:172-175): megatron-core 0.16.1's GPTModel
   (LanguageModule.__init__ -> ProcessGroupCollection.use_mpu_process_groups,
   process_groups_config.py:248) asserts "Intra partial data parallel group is not initialized";
   Megatron-LM's save_checkpoint (checkpointing.py:535-536) asserts "pipeline_model parallel group is
   not initialized"; and megatron.core.utils.get_pg_size answers 1 for the fake TP group while
   torch.distributed is not initialised, so at tp > 1 the model is built at tp = 1 shapes ("size
   mismatch for embedding.word_embeddings.weight ... [256, 64] ... [512, 64]").  Here each of the
   two processes first makes a one-process gloo group (in-process HashStore) and
   `parallel_state.initialize_model_parallel(1, 1)`; the tools then install their fake groups
   as they do.
3. convert.py:166 joins the saver process without checking its exit code: a failed saver still
   exits 0.  The test therefore checks the written files, not the status alone.

CPU-only shims (a GPU machine with TE and apex needs none of these):
* tests/megatron_lm_checkout.py's (six, the triton-only batch-invariant kernels,
  torch.cuda.get_rng_state / synchronize, megatron-core's CUDA scalars);
* megatron/legacy/fused_kernels `load` (called by the loader and saver) reads `nvcc -V` under
  torch's CUDA_HOME (None in a CPU build of torch) and loads nothing at this tag: a no-op;
* saver_base.py:43 asserts transformer-engine >= 0.12 is installed even with
  --saver-transformer-impl local (its only other work, putting Megatron-LM on sys.path, is done):
  skipped;
* both tools' argv get megatron_lm_checkout.CPU_FLAGS (no persistent / fused kernels, which need
  apex; without them local LayerNorm asserts "persist_layer_norm not supported by torch LayerNorm");
* validate_args' get_device_arch_version (arguments.py:928, CUDA device properties) answers 9
  (Hopper) at tp > 1, with CUDA_DEVICE_MAX_CONNECTIONS=1 as Megatron-LM requires there.
"""
from __future__ import annotations

import os
import runpy
import sys

import torch

from megatron_lm_checkout import CPU_FLAGS, MEGATRON_LM, import_megatron_lm, megatron_lm_on_cpu


def _one_process_parallel_state(tool) -> None:
    """Workaround 2: megatron-core's parallel state for one process before the tool's own setup."""
    from megatron.core import parallel_state
    real = tool.initialize_megatron_env

    def initialize_megatron_env(self):
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
        real(self)
    tool.initialize_megatron_env = initialize_megatron_env


def _cpu_flags(tool) -> None:
    real = tool.build_sys_argv
    tool.build_sys_argv = lambda self: [*real(self), *CPU_FLAGS]


def main(argv: list[str]) -> None:
    import_megatron_lm()
    sys.path.insert(0, os.path.join(MEGATRON_LM, "tools", "checkpoint"))
    import loader_base
    import loader_core
    import saver_base
    import megatron.training.arguments
    from megatron.legacy import fused_kernels

    stored_partial = loader_core.MegatronCheckpointLoaderLLM.import_model_provider

    def import_model_provider(self):  # workaround 1
        stored_partial(self)
        return self.model_provider
    loader_core.MegatronCheckpointLoaderLLM.import_model_provider = import_model_provider
    for tool in (loader_base.MegatronCheckpointLoaderBase, saver_base.MegatronCheckpointSaverBase):
        _one_process_parallel_state(tool)
        _cpu_flags(tool)
    fused_kernels.load = lambda args: None
    saver_base.MegatronCheckpointSaverBase.insert_megatron_path_and_check_te = lambda self: None
    megatron.training.arguments.get_device_arch_version = lambda: 9
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    script = os.path.join(MEGATRON_LM, "tools", "checkpoint", "convert.py")
    sys.argv = [script, *argv]
    with megatron_lm_on_cpu():  # inherited by the saver process (forked)
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])

"""`hf-megatron train --load` of a checkpoint Megatron-LM (core_v0.16.1) writes with --ckpt-format torch_dist.

megatron-core trains its GPTModel K steps with its own optimizer and scheduler (tests/test_megatron_optimizer.py's
run), then the iteration folder is written as Megatron-LM's `save_checkpoint` does for torch_dist
(`generate_state_dict` with use_dist_ckpt): the model's `sharded_state_dict(metadata=...)`, the optimizer's
`sharded_state_dict(state_dict, metadata=...)` built on it, and the common entries (args, checkpoint_version,
iteration, opt_param_scheduler, num_floating_point_operations_so_far), all through
`megatron.core.dist_checkpointing.save` with the default torch_dist strategy.  Our resume continues with
megatron-core's next losses and holds its Adam moments, step and fp32 main weights name by name.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from test_megatron_optimizer import K, check_train_resumes_megatron_lm

# Megatron-LM's _build_sharded_state_dict_metadata for a run without the distributed optimizer
SHARDED_SD_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def save_torch_dist(folder: Path, args, model, optimizer, scheduler) -> None:
    from megatron.core import dist_checkpointing
    args.ckpt_format = "torch_dist"
    state_dict = {"args": args, "checkpoint_version": 3.0, "iteration": K}
    state_dict["model"] = model.sharded_state_dict(metadata=SHARDED_SD_METADATA)
    state_dict["optimizer"] = optimizer.sharded_state_dict(state_dict, metadata=SHARDED_SD_METADATA)
    state_dict["opt_param_scheduler"] = scheduler.state_dict()
    state_dict["num_floating_point_operations_so_far"] = 0
    folder.mkdir(parents=True)
    synchronize = torch.cuda.synchronize  # its writer waits for CUDA copies before writing: none on CPU
    torch.cuda.synchronize = lambda *a, **k: None
    try:
        dist_checkpointing.save(state_dict, str(folder), content_metadata=SHARDED_SD_METADATA)
    finally:
        torch.cuda.synchronize = synchronize


@pytest.mark.parametrize("arch, dtype", [("gpt2", "fp32"), ("qwen2", "bf16")])
def test_train_resumes_a_megatron_lm_torch_dist_checkpoint(arch, dtype, tmp_path):
    check_train_resumes_megatron_lm(tmp_path, arch, dtype, save_torch_dist)

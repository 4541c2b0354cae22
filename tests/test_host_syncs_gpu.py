"""A queued train step never makes the host wait for the GPU (GPU only; skipped without CUDA).

`queue_forward_backward` + `queue_update` (what `train_step` and `--defer-step-stats` queue before
their one read) run under `torch.cuda.set_sync_debug_mode("error")`: any blocking copy or
synchronise inside them raises.  Session 10 found two that made every step wait (bench/RESULTS.md):
the rotary tables copied from the host in each forward, and a host zero copied to the GPU after each
backward to start the loss sum."""
import pytest
import torch

from tiny import engine_batch, tiny_hf_model
from training_helpers import make_batches, training_config

from hf_megatron.parallel import state
from hf_megatron.training import build_model, build_optimizer, setup_parallel, split_batch
from hf_megatron.training.trainer import queue_forward_backward, queue_update, read_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_queued_step_does_not_block_the_host(arch):
    cfg = training_config({}, bf16=True)
    setup_parallel(cfg)
    try:
        chunks = build_model(tiny_hf_model(arch), cfg, device="cuda")
        optimizer = build_optimizer(chunks, cfg)
        batches = [[{k: v.cuda() for k, v in mb.items()} for mb in split_batch(engine_batch(b), cfg)]
                   for b in make_batches(3)]
        for micro in batches[:2]:  # warm-up: first-use copies, kernel builds, lazy buffers
            step = queue_forward_backward(chunks, optimizer, micro)
            queue_update(step, chunks, optimizer)
            read_step(step, optimizer, None)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step = queue_forward_backward(chunks, optimizer, batches[2])
            queue_update(step, chunks, optimizer)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        stats = read_step(step, optimizer, None)
        assert stats["loss"] == stats["loss"] and stats["grad_norm"] is not None
    finally:
        state.reset()

"""Megatron-LM's REAL training checkpoint code (tag core_v0.16.1) against ours, both ways, on CPU.

Runs only when HF_MEGATRON_MEGATRON_LM names a Megatron-LM checkout (the folder holding
`megatron/training`); skipped otherwise: CI has no network and no checkout.  How the checkout's
`megatron.training` is combined with the megatron-core 0.16.1 wheel, and every CPU shim, is in
tests/megatron_lm_checkout.py's docstring (six and triton stubbed only where their import fails;
torch.cuda.get_rng_state -> the CPU generator around save_checkpoint; megatron-core's CUDA scalars
on CPU as tests/test_megatron_optimizer.py's megatron_core_on_cpu).  Everything runs in a spawned
gloo process, so this pytest process never imports megatron.training.

* Megatron-LM -> ours: Megatron-LM's parse_args / load_args_from_checkpoint (the model's args from
  our converted checkpoint) / validate_args build its args from the same flags `hf-megatron train`
  is given; its gpt_builder builds the megatron-core GPTModel, its optimizer config and
  get_optimizer_param_scheduler the optimizer and scheduler; after K steps its own
  `save_checkpoint` writes iteration K (--ckpt-format torch, then torch_dist).
  `hf-megatron train --load` continues with megatron-core's next two losses, and our reader
  holds megatron-core's Adam moments, step and main weights name by name, and the RNG it saved.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_lm_checkout import (import_megatron_lm, megatron_lm_args, megatron_lm_model, megatron_lm_on_cpu,
                                  megatron_lm_optimizer_and_scheduler, requires_megatron_lm)
from test_megatron_optimizer import (GBS, K, PADDED_VOCAB, _cpu_stand_ins, check_train_resumes_megatron_lm,
                                     megatron_core_state, next_two_losses, resume_flags, train_k_steps)

pytestmark = requires_megatron_lm


def megatron_lm_flags(root: Path, dtype: str, *extra) -> list:
    """`pretrain_gpt.py` flags of the run `hf-megatron train` is compared with: the same data,
    batch, schedule and AdamW flags (resume_flags), the vocabulary of the converted model (ids
    only: NullTokenizer), its norm epsilon (Megatron-LM's load_args_from_checkpoint does not copy
    it) from the HF config."""
    hf_config = json.loads((root / "hf" / "config.json").read_text())
    eps = hf_config.get("layer_norm_epsilon", hf_config.get("rms_norm_eps"))
    return [*resume_flags(root, dtype), "--tokenizer-type", "NullTokenizer", "--vocab-size", PADDED_VOCAB,
            "--norm-epsilon", eps, *extra]


def _megatron_lm_trains_and_saves(rank, world, root, dtype, ckpt_format):
    """K steps of Megatron-LM's model / optimizer / scheduler, iteration K written by its
    save_checkpoint into <root>/megatron_lm, then its next two losses (next_two_losses).
    Returns (losses, megatron-core's state at K by name)."""
    checkpointing = import_megatron_lm()
    from megatron.core import parallel_state
    root = Path(root)
    args = megatron_lm_args(megatron_lm_flags(root, dtype, "--train-iters", K + 2, "--save", root / "megatron_lm",
                                              "--save-interval", K, "--ckpt-format", ckpt_format),
                            checkpoint_args_from=root / "converted")
    parallel_state.initialize_model_parallel(1, 1)
    _cpu_stand_ins()
    torch.manual_seed(3)
    model = megatron_lm_model(args)
    optimizer, scheduler = megatron_lm_optimizer_and_scheduler(model, args)
    step = train_k_steps(model, optimizer, scheduler)
    args.consumed_train_samples = K * GBS  # what its train loop counts
    random.seed(11), np.random.seed(12), torch.manual_seed(13)  # states no other step of the test has
    with megatron_lm_on_cpu():
        # what get_rng_state collects now, for the test to compare with what our reader restores
        torch.save(checkpointing.get_rng_state("torch", None, None), root / "megatron_lm_rng_state.pt")
        checkpointing.save_checkpoint(K, [model], optimizer, scheduler, num_floating_point_operations_so_far=0)
    saved = megatron_core_state(model, optimizer)
    losses = next_two_losses(root, step, model)
    parallel_state.destroy_model_parallel()
    return losses, saved


def _check_rng_restored(root: Path, arch: str, dtype: str) -> None:
    """Our load_checkpoint sets Python's, numpy's and torch's generators to what Megatron-LM saved."""
    from hf_megatron.parallel import state
    from hf_megatron.training import build_model, setup_parallel
    from hf_megatron.training.checkpoint import load_checkpoint
    from tiny import tiny_hf_model
    from training_helpers import training_config
    saved = torch.load(root / "megatron_lm_rng_state.pt", weights_only=False)[0]
    cfg = training_config({}, bf16=dtype == "bf16")
    setup_parallel(cfg)
    chunks = build_model(tiny_hf_model(arch, vocab_size=PADDED_VOCAB), cfg)
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    load_checkpoint(root / "megatron_lm", chunks, None, load_rng=True)
    state.reset()
    assert random.getstate() == saved["random_rng_state"]
    got, want = np.random.get_state(), saved["np_rng_state"]
    assert got[0] == want[0] and np.array_equal(got[1], want[1]) and got[2:] == want[2:]
    assert torch.equal(torch.get_rng_state(), saved["torch_rng_state"])


@pytest.mark.parametrize("arch, dtype, ckpt_format", [
    ("gpt2", "fp32", "torch"), ("qwen2", "bf16", "torch_dist"),
    pytest.param("qwen2", "bf16", "torch", marks=pytest.mark.slow),
    pytest.param("gpt2", "fp32", "torch_dist", marks=pytest.mark.slow)])
def test_train_resumes_megatron_lms_own_save_checkpoint(arch, dtype, ckpt_format, tmp_path):
    check_train_resumes_megatron_lm(tmp_path, arch, dtype, ckpt_format, run=_megatron_lm_trains_and_saves)
    iteration = tmp_path / "megatron_lm" / f"iter_{K:07d}"
    written = {p.name for p in iteration.iterdir()}
    if ckpt_format == "torch":
        assert written == {"mp_rank_00"} and (iteration / "mp_rank_00" / "model_optim_rng.pt").is_file()
    else:  # megatron-core's dist_checkpointing layout: DCP shards + common.pt + metadata.json
        assert {".metadata", "common.pt", "metadata.json"} <= written and any(n.endswith(".distcp") for n in written)
    assert (tmp_path / "megatron_lm" / "latest_checkpointed_iteration.txt").read_text() == str(K)
    _check_rng_restored(tmp_path, arch, dtype)

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
  holds megatron-core's Adam moments, step and main weights name by name, and the RNG it saved;
  the model is read from Megatron-LM's own args (no hf_config of ours in them).  Measured:
  gpt2 fp32 rel 8.0e-8 and 0 (torch and torch_dist), qwen2 bf16 7.2e-6 and 1.8e-5.
* ours -> Megatron-LM: `hf-megatron train --save` (torch format, fp32 and bf16, no distributed
  optimizer) runs K + 2 iterations saving at K; Megatron-LM builds its args from that
  checkpoint (load_args_from_checkpoint) and its model / optimizer / scheduler as above, and its
  own `load_checkpoint` (RNG included, --ckpt-step K) gives iteration K, args.consumed_train_samples
  K * GBS, our scheduler entry (its _check_and_set checks pass), every model tensor bit for bit,
  and Adam step / moments / fp32 main weights equal to what our trainer resumes; megatron-core's
  next two losses equal our uninterrupted run's.  Measured: gpt2 fp32 rel 8.0e-8 and 0, qwen2
  bf16 4.8e-6 and 1.7e-5.
* Megatron-LM's tools/checkpoint/convert.py --loader core --saver core on our converted GPT-2
  (tp 1 -> 1, 2 -> 2, 2 -> 1): bit-identical rank files, back to the HF weights exactly; run
  through tests/megatron_lm_convert.py, which works around core_v0.16.1's own converter faults
  (it fails on any checkpoint before reading a tensor; listed there with file:line).
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dist import run_distributed
from megatron_lm_checkout import (import_megatron_lm, megatron_lm_args, megatron_lm_model, megatron_lm_on_cpu,
                                  megatron_lm_optimizer_and_scheduler, requires_megatron_lm)
from test_megatron_optimizer import (GBS, K, PADDED_VOCAB, _cpu_stand_ins, check_train_resumes_megatron_lm,
                                     megatron_core_state, megatron_lm_train_step, next_two_losses, resume_flags,
                                     train_k_steps)
from test_torch_dist_resume import _check_rng_restored as check_rng_restored

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


def megatron_lm_run(checkpoint_args_from: Path, root: Path, dtype: str, *flags):
    """Megatron-LM's args (megatron_lm_flags + `flags`, the model's from `checkpoint_args_from`),
    model parallel state (tp = pp = 1), model, optimizer and scheduler; returns them with its
    checkpointing module."""
    checkpointing = import_megatron_lm()
    from megatron.core import parallel_state
    args = megatron_lm_args(megatron_lm_flags(root, dtype, "--train-iters", K + 2, *flags),
                            checkpoint_args_from=checkpoint_args_from)
    parallel_state.initialize_model_parallel(1, 1)
    _cpu_stand_ins()
    torch.manual_seed(3)
    model = megatron_lm_model(args)
    return checkpointing, args, model, *megatron_lm_optimizer_and_scheduler(model, args)


def _megatron_lm_trains_and_saves(rank, world, root, dtype, ckpt_format):
    """K steps of Megatron-LM's model / optimizer / scheduler, iteration K written by its
    save_checkpoint into <root>/megatron_lm, then its next two losses (next_two_losses).
    Returns (losses, megatron-core's state at K by name)."""
    from megatron.core import parallel_state
    root = Path(root)
    checkpointing, args, model, optimizer, scheduler = megatron_lm_run(
        root / "converted", root, dtype, "--save", root / "megatron_lm", "--save-interval", K, "--ckpt-format", ckpt_format)
    step = train_k_steps(model, optimizer, scheduler)
    args.consumed_train_samples = K * GBS  # what its train loop counts
    random.seed(11), np.random.seed(12), torch.manual_seed(13)  # states no other step of the test has
    (root / "megatron_lm").mkdir()
    with megatron_lm_on_cpu():
        # what get_rng_state collects now, for the test to compare with what our reader restores
        torch.save(checkpointing.get_rng_state("torch", None, None), root / "megatron_lm" / "rng_state_saved.pt")
        checkpointing.save_checkpoint(K, [model], optimizer, scheduler, num_floating_point_operations_so_far=0)
    saved = megatron_core_state(model, optimizer)
    losses = next_two_losses(root, step, model)
    parallel_state.destroy_model_parallel()
    return losses, saved


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
    # the args our reader took the model from are Megatron-LM's own (no hf_config of ours)
    entry = iteration / ("mp_rank_00/model_optim_rng.pt" if ckpt_format == "torch" else "common.pt")
    args = torch.load(entry, weights_only=False)["args"]
    assert not hasattr(args, "hf_config") and args.ckpt_format == ckpt_format
    assert args.consumed_train_samples == K * GBS and args.padded_vocab_size == PADDED_VOCAB
    check_rng_restored(tmp_path, arch, dtype)  # the RNG Megatron-LM's get_rng_state collected


# ---------------------------------------------------------------- ours -> Megatron-LM

def _megatron_lm_loads_ours(rank, world, root, dtype):
    """Megatron-LM's load_checkpoint of iteration K of our run (<root>/ours, --ckpt-step K) into
    its model, optimizer and scheduler, built from the checkpoint's args (load_args_from_checkpoint,
    as --use-checkpoint-args does); then megatron-core's next two losses (next_two_losses)."""
    from megatron.core import parallel_state
    from test_megatron_optimizer import param_names
    root = Path(root)
    checkpointing, args, model, optimizer, scheduler = megatron_lm_run(
        root / "ours", root, dtype, "--load", root / "ours", "--ckpt-format", "torch", "--ckpt-step", K)
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    with megatron_lm_on_cpu():
        iteration, _ = checkpointing.load_checkpoint([model], optimizer, scheduler)
    got = {"iteration": iteration, "consumed_train_samples": args.consumed_train_samples,
           "scheduler": scheduler.state_dict(),
           "model": {n: p.detach().clone() for n, p in param_names(model).items()},
           "state": megatron_core_state(model, optimizer), "torch_rng_state": torch.get_rng_state(),
           "random_rng_state": random.getstate()}
    got["losses"] = next_two_losses(root, megatron_lm_train_step(model, optimizer, scheduler), model)
    parallel_state.destroy_model_parallel()
    return got


def _our_optimizer_state(folder: Path, arch: str, dtype: str) -> dict:
    """Our optimizer's state at iteration K as our trainer resumes it (test_megatron_optimizer.our_state)."""
    from hf_megatron.parallel import state
    from hf_megatron.training import build_model, build_optimizer, setup_parallel
    from hf_megatron.training.checkpoint import load_checkpoint
    from test_megatron_optimizer import our_state
    from tiny import tiny_hf_model
    from training_helpers import training_config
    cfg = training_config({}, bf16=dtype == "bf16")
    setup_parallel(cfg)
    chunks = build_model(tiny_hf_model(arch, vocab_size=PADDED_VOCAB), cfg)
    optimizer = build_optimizer(chunks, cfg)
    assert load_checkpoint(folder, chunks, optimizer, load_rng=False, iteration=K) == K
    loaded = our_state(chunks[0], optimizer)
    state.reset()
    return loaded


@pytest.mark.parametrize("arch, dtype", [("gpt2", "fp32"), ("qwen2", "bf16")])
def test_megatron_lms_own_load_checkpoint_resumes_our_training_checkpoint(arch, dtype, tmp_path):
    from test_convert_helpers import save_hf
    from test_megatron_optimizer import _tensorboard_losses
    from train_cli import cli_inprocess, make_workspace
    make_workspace(tmp_path)
    hf = save_hf(tmp_path / "hf", arch, vocab_size=PADDED_VOCAB)  # no padded rows (see test_megatron_optimizer)
    code, out, err = cli_inprocess("--hf-model", hf, *resume_flags(tmp_path, dtype), "--train-iters", K + 2,
                                   "--save", tmp_path / "ours", "--save-interval", K, "--tensorboard-dir", tmp_path / "tb")
    assert code == 0, err[-3000:]
    ours = _tensorboard_losses(tmp_path / "tb")  # our uninterrupted run
    got = run_distributed(_megatron_lm_loads_ours, 1, (str(tmp_path), dtype))[0]
    entry = torch.load(tmp_path / "ours" / f"iter_{K:07d}" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert got["iteration"] == K and got["consumed_train_samples"] == K * GBS
    # the scheduler: its checks passed (_check_and_set: same max/min lr, warmup, decay steps, style,
    # and the weight-decay keys start_wd, end_wd, wd_incr_steps, wd_incr_style) and it holds our step count
    ours_scheduler = entry["opt_param_scheduler"]
    assert {k: got["scheduler"][k] for k in ours_scheduler} == ours_scheduler and ours_scheduler["num_steps"] == K * GBS
    # the model: every tensor of ours, bit for bit (Megatron-LM falls back to strict=False silently)
    assert sorted(got["model"]) == sorted(k for k in entry["model"] if not k.endswith("_extra_state"))
    for name, tensor in got["model"].items():
        assert tensor.dtype == entry["model"][name].dtype and torch.equal(tensor, entry["model"][name]), name
    # the optimizer: Adam step, moments and fp32 main weights are ours, name by name
    mine = _our_optimizer_state(tmp_path / "ours", arch, dtype)
    assert sorted(mine) == sorted(got["state"])
    for name, (step, exp_avg, exp_avg_sq, main) in got["state"].items():
        assert step == mine[name][0] == float(K), name
        assert torch.equal(exp_avg, mine[name][1]) and torch.equal(exp_avg_sq, mine[name][2]), name
        assert torch.equal(main, mine[name][3]), name
    # the RNG Megatron-LM restored (torch's CPU generator, Python's) is what we saved
    rng = entry["rng_state"][0]
    assert torch.equal(got["torch_rng_state"], rng["torch_rng_state"]) and got["random_rng_state"] == rng["random_rng_state"]
    # megatron-core continues our run with our losses
    tolerance = 1e-6 if dtype == "fp32" else 1e-3
    assert got["losses"][0] == pytest.approx(ours[K + 1], rel=tolerance)
    assert got["losses"][1] == pytest.approx(ours[K + 2], rel=tolerance)


# ---------------------------------------------------------------- Megatron-LM's tools/checkpoint

@pytest.mark.parametrize("source_tp, target_tp", [(1, 1), (2, 2), pytest.param(2, 1, marks=pytest.mark.slow)])
def test_megatron_lm_convert_core_to_core_takes_our_checkpoint(source_tp, target_tp, tmp_path):
    """`convert.py --loader core --saver core` on `hf-megatron convert hf-to-megatron` output (GPT-2
    tiny), run WITH the workarounds for core_v0.16.1's own faults listed in
    tests/megatron_lm_convert.py (unpatched it fails on any checkpoint before reading a tensor):
    every rank file it writes holds our tensors bit for bit (padded vocabulary re-padded from
    --true-vocab-size), and `hf-megatron convert megatron-to-hf` of its output gives back the HF
    weights exactly."""
    from hf_megatron.conversion.convert import hf_to_megatron, megatron_to_hf
    from test_convert_helpers import assert_identical, hf_tensors, save_hf
    from tiny import VOCAB
    from train_cli import env
    hf = save_hf(tmp_path / "hf", "gpt2")
    hf_to_megatron(hf, tmp_path / "ours", tp=source_tp)
    expected = tmp_path / "ours"
    if target_tp != source_tp:
        hf_to_megatron(hf, tmp_path / "ours_at_target", tp=target_tp)
        expected = tmp_path / "ours_at_target"
    out = tmp_path / "converted_by_megatron_lm"
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "megatron_lm_convert.py"),
                           "--model-type", "GPT", "--loader", "core", "--saver", "core",
                           "--load-dir", str(tmp_path / "ours"), "--save-dir", str(out),
                           "--target-tensor-parallel-size", str(target_tp), "--true-vocab-size", str(VOCAB),
                           "--loader-transformer-impl", "local", "--saver-transformer-impl", "local"],
                          env=env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "Done!" in done.stdout, (done.stdout + done.stderr)[-4000:]
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "0"
    for rank in range(target_tp):
        theirs = torch.load(out / "iter_0000000" / f"mp_rank_{rank:02d}" / "model_optim_rng.pt", weights_only=False)
        ours = torch.load(expected / "release" / f"mp_rank_{rank:02d}" / "model_optim_rng.pt", weights_only=False)
        assert theirs["args"].tensor_model_parallel_size == target_tp
        assert_identical({k: v for k, v in theirs["model"].items() if not k.endswith("_extra_state")},
                         {k: v for k, v in ours["model"].items() if not k.endswith("_extra_state")})
    megatron_to_hf(out, tmp_path / "back", tokenizer=hf)
    assert_identical(hf_tensors(tmp_path / "back"), hf_tensors(hf))

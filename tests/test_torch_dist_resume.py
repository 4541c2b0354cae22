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

import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from test_megatron_optimizer import GBS, K, check_train_resumes_megatron_lm

# Megatron-LM's _build_sharded_state_dict_metadata for a run without the distributed optimizer
SHARDED_SD_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def megatron_lm_rng_state() -> dict:
    """Megatron-LM's get_rng_state entry.  No CUDA here: the CPU generator's state stands in for
    cuda_rng_state (a restore sets that only on CUDA); megatron-core's tracker holds no stream on CPU."""
    from megatron.core import tensor_parallel
    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),
            "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}


def save_torch_dist(folder: Path, args, model, optimizer, scheduler) -> None:
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    args.ckpt_format, args.no_save_rng = "torch_dist", False
    state_dict = {"args": args, "checkpoint_version": 3.0, "iteration": K}
    folder.mkdir(parents=True)
    random.seed(11), np.random.seed(12), torch.manual_seed(13)  # states no other step of the test has
    rng_state = [megatron_lm_rng_state()]
    torch.save(rng_state, folder.parent / "rng_state_saved.pt")  # for the test to compare with
    # get_rng_state with use_dist_ckpt: one object on the (pp, tp) grid, dp ranks replicas
    state_dict["rng_state"] = ShardedObject("rng_state", rng_state, (1, 1), (0, 0), replica_id=0)
    save_sharded(folder, state_dict, model, optimizer, scheduler, SHARDED_SD_METADATA)


def save_sharded(folder: Path, state_dict: dict, model, optimizer, scheduler, metadata: dict) -> None:
    """The rest of generate_state_dict (the model's and the optimizer's sharded state dicts, the scheduler)
    and `dist_checkpointing.save` of it into `folder` (collective)."""
    from megatron.core import dist_checkpointing
    state_dict["model"] = model.sharded_state_dict(metadata=metadata)
    state_dict["optimizer"] = optimizer.sharded_state_dict(state_dict, metadata=metadata)
    state_dict["opt_param_scheduler"] = scheduler.state_dict()
    state_dict["num_floating_point_operations_so_far"] = 0
    synchronize = torch.cuda.synchronize  # its writer waits for CUDA copies before writing: none on CPU
    torch.cuda.synchronize = lambda *a, **k: None
    try:
        dist_checkpointing.save(state_dict, str(folder), content_metadata=metadata)
    finally:
        torch.cuda.synchronize = synchronize


def _load_in_layout(rank, world, root, arch, dtype, saved, layout):
    """Our reader in another layout than the saved tp=1, pp=1 (`layout`: tp or pp of world): every
    param of this rank holds its TP shard of megatron-core's moments, step and main weight.
    (names this rank holds, names that differ)."""
    from hf_megatron.parallel import state
    from hf_megatron.parallel.sharding import split_tensor
    from hf_megatron.training import build_model, build_optimizer, setup_parallel
    from hf_megatron.training.checkpoint import load_checkpoint
    from test_megatron_optimizer import PADDED_VOCAB, our_state
    from tiny import tiny_hf_model
    from training_helpers import training_config
    cfg = training_config(layout, bf16=dtype == "bf16")
    setup_parallel(cfg)
    chunks = build_model(tiny_hf_model(arch, vocab_size=PADDED_VOCAB), cfg)
    optimizer = build_optimizer(chunks, cfg)
    assert load_checkpoint(Path(root) / "megatron_lm", chunks, optimizer, load_rng=False) == K
    loaded, config, tp = our_state(chunks[0], optimizer), chunks[0].config, layout.get("tp", 1)
    state.reset()
    wrong = []
    for name, (step, *tensors) in loaded.items():
        want = saved.get(name)
        if want is None:
            wrong.append(name)
            continue
        shards = [split_tensor(name, t, config, tp)[rank if tp > 1 else 0] for t in want[1:]]
        if step != want[0] or not all(torch.equal(a, b) for a, b in zip(tensors, shards)):
            wrong.append(name)
    return sorted(loaded), wrong


def _check_rng_restored(tmp_path: Path, arch: str, dtype: str) -> None:
    """load_checkpoint sets Python's, numpy's and torch's generators to what Megatron-LM saved."""
    from hf_megatron.parallel import state
    from hf_megatron.training import build_model, setup_parallel
    from hf_megatron.training.checkpoint import load_checkpoint
    from test_megatron_optimizer import PADDED_VOCAB
    from tiny import tiny_hf_model
    from training_helpers import training_config
    saved = torch.load(tmp_path / "megatron_lm" / "rng_state_saved.pt", weights_only=False)[0]
    cfg = training_config({}, bf16=dtype == "bf16")
    setup_parallel(cfg)
    chunks = build_model(tiny_hf_model(arch, vocab_size=PADDED_VOCAB), cfg)
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    info = {}
    load_checkpoint(tmp_path / "megatron_lm", chunks, None, load_rng=True, info=info)
    state.reset()
    assert random.getstate() == saved["random_rng_state"]
    got, want = np.random.get_state(), saved["np_rng_state"]
    assert got[0] == want[0] and np.array_equal(got[1], want[1]) and got[2:] == want[2:]
    assert torch.equal(torch.get_rng_state(), saved["torch_rng_state"])
    assert info["rng_state"][0]["rng_tracker_states"] == saved["rng_tracker_states"]


def _load_into_distributed_optimizer(rank, world, root, arch, saved):
    """Our --use-distributed-optimizer over dp=world loads it: the dp-gathered state on dp rank 0 is
    megatron-core's, param by param; [] when it is."""
    from hf_megatron.parallel import state
    from hf_megatron.training import build_model, build_optimizer, setup_parallel
    from hf_megatron.training.checkpoint import load_checkpoint
    from test_megatron_optimizer import PADDED_VOCAB
    from tiny import tiny_hf_model
    from training_helpers import training_config
    cfg = training_config({"zero": True})
    setup_parallel(cfg)
    chunks = build_model(tiny_hf_model(arch, vocab_size=PADDED_VOCAB), cfg)
    optimizer = build_optimizer(chunks, cfg)
    assert optimizer.sharded and load_checkpoint(Path(root) / "megatron_lm", chunks, optimizer, load_rng=False) == K
    gathered, names = optimizer.parameter_state(), {id(p): n for n, p in chunks[0].named_parameters()}
    state.reset()
    if gathered is None:
        return []
    wrong, at = [] if int(gathered["step"]) == K else ["step"], 0
    for p in optimizer.model_params:
        name, n = names[id(p)], p.numel()
        _, exp_avg, exp_avg_sq, main = saved[name]
        got = [gathered[key][at:at + n].view(p.shape) for key in ("param", "exp_avg", "exp_avg_sq")]
        if not all(torch.equal(a, b) for a, b in zip(got, (main, exp_avg, exp_avg_sq))):
            wrong.append(name)
        at += n
    return wrong


def _check_megatron_lm_load_flags(tmp_path, dtype) -> None:
    """Megatron-LM's load flags on its torch_dist checkpoint: --ckpt-step names the saved iteration (another is
    refused in one line), --auto-detect-ckpt-format / --ckpt-format torch are accepted (--load always detects),
    --finetune and --no-load-rng start at iteration 0 from its weights."""
    from test_megatron_optimizer import resume_flags
    from train_cli import cli_inprocess, error_line
    args = ("--load", tmp_path / "megatron_lm", "--train-iters", K + 1, *resume_flags(tmp_path, dtype))
    code, out, err = cli_inprocess(*args, "--ckpt-step", K, "--ckpt-format", "torch", "--auto-detect-ckpt-format")
    assert code == 0 and f"iteration      {K + 1}/{K + 1}" in out, err[-3000:]
    line = error_line(cli_inprocess(*args, "--ckpt-step", K + 3))
    assert line == (f"hf-megatron train: error: --ckpt-step {K + 3}: {tmp_path / 'megatron_lm'} has no "
                    f"iter_{K + 3:07d}; its iterations: iter_{K:07d}")
    code, out, err = cli_inprocess(*args[:3], 1, *args[4:], "--finetune", "--no-load-rng")
    assert code == 0 and re.search(r"iteration\s+1/1\b", out), err[-3000:]  # from iteration 0


@pytest.mark.parametrize("arch, dtype, layout", [("gpt2", "fp32", None), ("qwen2", "bf16", {"tp": 2}),
                                                  pytest.param("qwen2", "bf16", {"pp": 2}, marks=pytest.mark.slow)])
def test_train_resumes_a_megatron_lm_torch_dist_checkpoint(arch, dtype, layout, tmp_path):
    from dist import run_distributed
    saved = check_train_resumes_megatron_lm(tmp_path, arch, dtype, save_torch_dist)
    _check_rng_restored(tmp_path, arch, dtype)
    from hf_megatron.training.checkpoint import checkpoint_info
    info = checkpoint_info(tmp_path / "megatron_lm")  # what evaluate / accelerate's load_state read
    assert info["iteration"] == K and info["args"]["consumed_train_samples"] == K * GBS
    if layout is not None:  # another layout than the saved one: torch_dist holds global tensors
        ranks = run_distributed(_load_in_layout, 2, (str(tmp_path), arch, dtype, saved, layout))
        assert [wrong for _, wrong in ranks] == [[], []]
        assert sorted({n for names, _ in ranks for n in names}) == sorted(saved)
        return
    assert run_distributed(_load_into_distributed_optimizer, 2, (str(tmp_path), arch, saved)) == [[], []]
    _check_megatron_lm_load_flags(tmp_path, dtype)
    # without its optimizer state: refused in one line unless --no-load-optim says so
    from hf_megatron.checkpoint.unpickle import safe_load
    from test_megatron_optimizer import resume_flags
    from train_cli import cli_inprocess
    common_file = tmp_path / "megatron_lm" / f"iter_{K:07d}" / "common.pt"
    common = safe_load(common_file)
    del common["optimizer"]
    torch.save(common, common_file)
    args = ("--load", tmp_path / "megatron_lm", "--train-iters", K + 1, *resume_flags(tmp_path, dtype))
    code, out, err = cli_inprocess(*args)
    assert code != 0
    assert f"{common_file}: holds no optimizer state" in err and "--no-load-optim" in err
    assert len(err.strip().splitlines()) == 1, err
    code, out, err = cli_inprocess(*args, "--no-load-optim")
    assert code == 0, err[-3000:]
    assert f"iteration      {K + 1}/{K + 1}" in out
    for bad, message in (({"state": {}, "param_groups": ["x"]}, "optimizer entry is neither FP32Optimizer's"),
                         ({"state": {"common_step": "2"}, "param_groups": []}, "common_step should be a number")):
        common["optimizer"] = bad
        torch.save(common, common_file)
        code, out, err = cli_inprocess(*args)
        assert code != 0 and len(err.strip().splitlines()) == 1 and message in err, err
    # megatron-core's distributed optimizer's entry (what remains of it in common.pt) without its tensors, or in
    # a sharding not read (tests/test_torch_dist_distrib_optim.py reads the two Megatron-LM writes): refused, not reset
    for sharding, message in (("dp_reshardable", "no entry optimizer.distributed.dp_group_idx_0.optimizer"),
                              ("fully_sharded_model_space", "in its 'fully_sharded_model_space' sharding is not read")):
        common["optimizer"] = {"param_state": {}, "param_state_sharding_type": sharding}
        torch.save(common, common_file)
        code, out, err = cli_inprocess(*args)
        assert code != 0 and len(err.strip().splitlines()) == 1 and message in err, err

"""The distributed optimizer's checkpoint (megatron-core's layout: model_optim_rng.pt holds param
groups and loss scaler, distrib_optim.pt beside it the main weights and Adam moments gathered
from every dp rank into its grad-buffer tensors): a dp=2 run saved and resumed in fresh objects continues bit for bit, with
overlapped grad reduce and param gather, in fp32 and bf16; and a checkpoint written by one
optimizer loads into the other (full state <-> distributed), continuing within rel 1e-6 (the two
sum the squared grad norm in different orders).  Mirrors test_checkpoint_resume.py's 4-step run.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dist import run_distributed
from test_checkpoint_resume import SAVE_AT, batches, model_config, run_and_resume, training_config

OVERLAP = dict(use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
               ddp_bucket_size=3000)


def _train(objects, cfg, data):
    from hf_megatron.training.trainer import split_batch, train_step
    from tiny import engine_batch
    chunks, optimizer, scheduler = objects
    return [train_step(chunks, optimizer, scheduler, split_batch(engine_batch(b), cfg))["loss"] for b in data]


def _fresh(cfg, config, seed):
    from hf_megatron.training.trainer import build_model, build_optimizer, build_scheduler, setup_parallel
    setup_parallel(training_config(**{**cfg.__dict__, "seed": seed}))
    chunks = build_model(config, cfg)
    optimizer = build_optimizer(chunks, cfg)
    return chunks, optimizer, build_scheduler(optimizer, cfg)


def _switch(save_cfg, load_cfg, config, save_dir, rewrite=None):
    """(uninterrupted losses under load_cfg, losses saved under save_cfg and resumed under load_cfg);
    `rewrite(rank dir, optimizer)`, when given, turns the saved rank folder into another layout."""
    from hf_megatron.training.checkpoint import load_checkpoint, save_checkpoint
    data = batches()
    uninterrupted = _train(_fresh(load_cfg, config, load_cfg.seed), load_cfg, data)
    first = _fresh(save_cfg, config, save_cfg.seed)
    interrupted = _train(first, save_cfg, data[:SAVE_AT])
    save_checkpoint(save_dir, SAVE_AT, *first)
    if rewrite is not None:
        rewrite(Path(save_dir) / f"iter_{SAVE_AT:07d}" / "mp_rank_00", first[1])
    second = _fresh(load_cfg, config, load_cfg.seed + 1)
    assert load_checkpoint(save_dir, *second) == SAVE_AT
    return uninterrupted, interrupted + _train(second, load_cfg, data[SAVE_AT:])


def _resume_worker(rank, world, save_root, precisions):
    from hf_megatron.checkpoint.unpickle import safe_load
    out = {name: run_and_resume(training_config(**OVERLAP, **extra), model_config(), f"{save_root}/{name}")
           for name, extra in precisions}
    rank_dir = f"{save_root}/{precisions[0][0]}/iter_{SAVE_AT:07d}/mp_rank_00"
    out["model_file"] = safe_load(f"{rank_dir}/model_optim_rng.pt")["optimizer"]
    return out


def test_distributed_optimizer_resumes_exactly(tmp_path):
    results = run_distributed(_resume_worker, 2, (str(tmp_path), [("fp32", {})]))
    for r in results:
        uninterrupted, resumed = r["fp32"]
        assert resumed == uninterrupted
        assert len(set(uninterrupted)) == len(uninterrupted)
    # megatron-core's DistributedOptimizer.state_dict(): param groups without params, with the step; no
    # scaler (fp32); distrib_optim.pt its get_parameter_state_dp_zero() (test_megatron_distrib_optim.py
    # has megatron-core load both)
    entry = results[0]["model_file"]
    assert set(entry) == {"optimizer"} and set(entry["optimizer"]) == {"param_groups"}
    assert [g["step"] for g in entry["optimizer"]["param_groups"]] == [float(SAVE_AT)] * 2
    assert not any("params" in g for g in entry["optimizer"]["param_groups"])
    rank_dir = tmp_path / "fp32" / f"iter_{SAVE_AT:07d}" / "mp_rank_00"
    files = ["distrib_optim.pt", "model_optim_rng.pt"]  # each with its sha256 sidecar
    assert sorted(p.name for p in rank_dir.iterdir()) == sorted(files + [f + ".sha256" for f in files])
    from hf_megatron.checkpoint.unpickle import safe_load
    saved = safe_load(rank_dir / "distrib_optim.pt")
    assert saved["buckets_coalesced"] is True and sorted(k for k in saved if k != "buckets_coalesced") == [0]
    (key, tensors), = saved[0].items()
    assert key == (torch.float32, torch.float32) and tensors["param"].numel() == tensors["numel_unpadded"]
    # the moments of both dp shards are there (~half would be 0 without rank 1; zero-grad rows of
    # unseen tokens, key biases and the 64-element alignment gaps leave a few)
    assert (tensors["exp_avg_sq"] > 0).float().mean() > 0.9
    args = safe_load(rank_dir / "model_optim_rng.pt")["args"]  # the flags the layout follows
    assert (args.use_distributed_optimizer, args.overlap_grad_reduce, args.ddp_bucket_size) == (True, True, 3000)


def _switch_worker(rank, world, save_root):
    out = run_and_resume(training_config(**OVERLAP, bf16=True), model_config(), f"{save_root}/bf16")
    plain, sharded = training_config(), training_config(use_distributed_optimizer=True)
    return {"bf16": out, "full_to_sharded": _switch(plain, sharded, model_config(), f"{save_root}/full"),
            "sharded_to_full": _switch(sharded, plain, model_config(), f"{save_root}/sharded")}


@pytest.mark.slow
def test_bf16_resume_and_checkpoints_switch_between_optimizers(tmp_path):
    for r in run_distributed(_switch_worker, 2, (str(tmp_path),)):
        uninterrupted, resumed = r["bf16"]
        assert resumed == uninterrupted
        for name in ("full_to_sharded", "sharded_to_full"):
            uninterrupted, resumed = r[name]
            for ours, ref in zip(resumed, uninterrupted):
                assert abs(ours - ref) <= 1e-6 * abs(ref), name


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_our_earlier_flat_distrib_optim_still_loads(dtype, tmp_path):
    """What our distributed optimizer wrote before it wrote megatron-core's layout: model_optim_rng.pt's
    entry {"optimizer": {"param_groups"}, "grad_scaler", "distributed_optimizer": True} and
    distrib_optim.pt = {"numels", "step", "param", "exp_avg", "exp_avg_sq"}, each tensor flat over the
    params in `model_params` order.  Written here by that rule from a trained optimizer's live state, it
    loads into the distributed optimizer with that state, name by name."""
    from hf_megatron.checkpoint.files import save_atomic
    from hf_megatron.checkpoint.unpickle import safe_load
    from hf_megatron.parallel import state
    from hf_megatron.training import build_optimizer
    from hf_megatron.training.checkpoint import load_checkpoint, save_checkpoint
    from test_megatron_optimizer import _trained, our_state
    state.reset()
    cfg, chunks, optimizer = _trained(dtype)
    expected = our_state(chunks[0], optimizer)
    save_checkpoint(tmp_path, 2, chunks, optimizer)
    rank_dir = tmp_path / "iter_0000002" / "mp_rank_00"
    payload = safe_load(rank_dir / "model_optim_rng.pt")
    payload["optimizer"] = {"optimizer": {"param_groups": optimizer.optimizer.state_dict()["param_groups"]},
                            "grad_scaler": {}, "distributed_optimizer": True}
    save_atomic(payload, rank_dir / "model_optim_rng.pt")
    name_of = {id(p): n for n, p in chunks[0].named_parameters()}
    names = [name_of[id(p)] for p in optimizer.model_params]
    flat = {"numels": [p.numel() for p in optimizer.model_params], "step": 2,
            **{key: torch.cat([expected[n][i].reshape(-1).float() for n in names])
               for key, i in (("param", 3), ("exp_avg", 1), ("exp_avg_sq", 2))}}
    save_atomic(flat, rank_dir / "distrib_optim.pt")
    fresh = build_optimizer(chunks, training_config(use_distributed_optimizer=True, bf16=dtype == "bf16"))
    assert fresh.sharded and load_checkpoint(tmp_path, chunks, fresh, load_rng=False) == 2
    got = our_state(chunks[0], fresh)  # dp 1: one fragment per param, whole
    state.reset()
    assert sorted(got) == sorted(expected)
    for name, (step, exp_avg, exp_avg_sq, main) in expected.items():
        assert got[name][0] == step == 2.0, name
        for mine, want in zip(got[name][1:], (exp_avg, exp_avg_sq, main)):
            assert torch.equal(mine.reshape(-1), want.reshape(-1)), name  # ours: flat fragments


def _older_torch_worker(rank, world):
    """The distributed optimizer's steps and its gathered checkpoint state, with torch >= 2.13's
    reduce_scatter_single / all_gather_single, then with them hidden (torch < 2.13 lacks them: the
    collectives fall back to reduce_scatter_tensor / all_gather_into_tensor)."""
    import torch.distributed as dist
    from hf_megatron.parallel import state
    cfg = training_config(**OVERLAP)
    out = []
    for hide in (False, True):
        hidden = {name: getattr(dist, name) for name in ("reduce_scatter_single", "all_gather_single")
                  if hide and hasattr(dist, name)}
        for name in hidden:
            delattr(dist, name)
        try:
            objects = _fresh(cfg, model_config(), cfg.seed)
            losses = _train(objects, cfg, batches())
            out.append((losses, objects[1].state_dict()))
        finally:
            for name, fn in hidden.items():
                setattr(dist, name, fn)
            state.reset()
    return out


@pytest.mark.slow  # 2 processes, ~28 s: a compatibility path (torch without the newer collective names)
def test_collectives_fall_back_to_the_names_older_torch_has():
    for (losses, saved), (older_losses, older_saved) in run_distributed(_older_torch_worker, 2, ()):
        assert losses == older_losses
        torch.testing.assert_close(older_saved, saved, rtol=0, atol=0)

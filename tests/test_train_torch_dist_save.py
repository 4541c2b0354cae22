"""`hf-megatron train --save DIR --ckpt-format torch_dist`: megatron-core's torch_dist training checkpoint
(hf_megatron/training/torch_dist_save.py), at tp 1, pp 1 without the distributed optimizer.

* Resume: `train --load` of it continues with the losses of an uninterrupted run, bit for bit (dropout on,
  so the RNG streams come back too), fp32 and bf16; --save-interval saves, staging, tracker, sidecars.
* megatron-core reads it: its GPTModel and optimizer (FP32Optimizer / Float16OptimizerWithFloat16Params)
  built from our args load the folder with its own `dist_checkpointing.load` of their sharded_state_dict
  (strict RAISE_ALL: every entry it expects is there and nothing else) and hold our weights, Adam moments,
  step and fp32 main weights name by name; saved again by megatron-core, the folder has our entries,
  shapes and dtypes and our common.pt keys.
* Layouts not written are refused in one line.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dist import run_distributed
from test_megatron_optimizer import (megatron_core_on_cpu, megatron_core_optimizer, megatron_core_state, mcore_model,
                                     our_state, _cpu_stand_ins)
from test_torch_dist_resume import save_sharded

K = 2


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_engine_resume_of_torch_dist_equals_uninterrupted_run(dtype, tmp_path):
    from hf_megatron.parallel import state
    from test_checkpoint_resume import STEPS, model_config, run_and_resume, training_config
    state.reset()
    uninterrupted, resumed = run_and_resume(training_config(bf16=dtype == "bf16"), model_config(), tmp_path,
                                            ckpt_format="torch_dist")
    assert resumed == uninterrupted and len(set(uninterrupted)) == STEPS
    folder = tmp_path / "iter_0000002"
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp", "__0_0.distcp.sha256",
                                                        "common.pt", "common.pt.sha256", "metadata.json"]


@pytest.mark.parametrize("dp, tp, pp", [(1, 1, 1), pytest.param(2, 1, 1, marks=pytest.mark.slow),
                                         pytest.param(1, 2, 1, marks=pytest.mark.slow),
                                         pytest.param(1, 1, 2, marks=pytest.mark.slow),
                                         pytest.param(2, 2, 2, marks=pytest.mark.slow)])
def test_train_cli_saves_torch_dist_and_resumes_it(dp, tp, pp, tmp_path):
    """dp 2: the state is replicated, global rank 0 writes the folder; the others' RNG streams are theirs.
    tp / pp 2: every rank's shards gathered onto global rank 0, merged, one rng_state entry per (pp, tp) cell."""
    from test_reshard_optimizer import losses, run_train
    from train_cli import base_args, cli_inprocess, error_line, make_workspace
    make_workspace(tmp_path)
    common = ("--ckpt-format", "torch_dist", "--hidden-dropout", 0.1, "--attention-dropout", 0.1,
              "--tensor-model-parallel-size", tp, "--pipeline-model-parallel-size", pp)
    world = dp * tp * pp
    run_train(world, *base_args(tmp_path, 4), "--save", tmp_path / "full", "--save-interval", 2,
              "--tensorboard-dir", tmp_path / "tb_full", *common)
    full = losses(tmp_path / "tb_full")
    run_train(world, *base_args(tmp_path, 4), "--save", tmp_path / "ck", "--exit-interval", 2, *common)
    out = run_train(world, *base_args(tmp_path, 4), "--load", tmp_path / "ck", "--save", tmp_path / "ck",
                    "--tensorboard-dir", tmp_path / "tb_resumed", *common)
    assert "iteration      3/4" in out and "iteration      1/4" not in out
    resumed = losses(tmp_path / "tb_resumed")
    assert [resumed[i] for i in (3, 4)] == [full[i] for i in (3, 4)]
    for root in (tmp_path / "full", tmp_path / "ck"):  # --save-interval 2 and the end; nothing staged left
        names = sorted(p.name for p in root.iterdir())
        assert [n for n in names if n.startswith((".iter", "iter_"))] == ["iter_0000002", "iter_0000004"], names
        assert (root / "latest_checkpointed_iteration.txt").read_text() == "4"
        assert not list(root.glob("iter_*/mp_rank_*"))
    from hf_megatron.training.checkpoint import checkpoint_info
    info = checkpoint_info(tmp_path / "ck")
    assert info["iteration"] == 4 and info["args"]["ckpt_format"] == "torch_dist"
    assert info["consumed_train_samples"] == info["args"]["consumed_train_samples"] == 16
    assert (info["args"]["tensor_model_parallel_size"], info["args"]["pipeline_model_parallel_size"]) == (tp, pp)
    rng = sorted(n for n in _entries(tmp_path / "ck" / "iter_0000004") if n.startswith("rng_state"))
    assert rng == [f"rng_state/shard_{p}.{t}_{pp}.{tp}" for p in range(pp) for t in range(tp)]
    if world > 1:
        return
    # the distributed optimizer is not written as torch_dist: one line naming the flag
    line = error_line(cli_inprocess(*base_args(tmp_path, 1), "--save", tmp_path / "no", *common,
                                    "--use-distributed-optimizer"))
    assert "--ckpt-format torch_dist with --use-distributed-optimizer" in line, line
    assert not (tmp_path / "no").exists()


def _ours_then_megatron_core(rank, world, arch, dtype, folder):
    """Our run of K steps saved as torch_dist; megatron-core's model + optimizer load it through
    dist_checkpointing (strict) and save it again beside it."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from hf_megatron.checkpoint.unpickle import safe_load
    from hf_megatron.parallel import state
    from hf_megatron.training import build_model, build_optimizer, build_scheduler, setup_parallel, split_batch, \
        train_step
    from hf_megatron.training.checkpoint import save_checkpoint
    from test_megatron_optimizer import HP
    from tiny import engine_batch, tiny_hf_model
    from training_helpers import make_batches, training_config
    cfg = training_config({"tp": world}, lr=HP["lr"], min_lr=HP["min_lr"], weight_decay=HP["weight_decay"],
                          adam_beta2=HP["beta2"], bf16=dtype == "bf16")
    setup_parallel(cfg)
    chunks = build_model(tiny_hf_model(arch), cfg)
    optimizer = build_optimizer(chunks, cfg)
    scheduler = build_scheduler(optimizer, cfg)
    for batch in make_batches(K):
        train_step(chunks, optimizer, scheduler, split_batch(engine_batch(batch), cfg))
    save_checkpoint(folder, K, chunks, optimizer, scheduler, ckpt_format="torch_dist")
    ours = our_state(chunks[0], optimizer)
    ours_weights = {n: t.clone() for n, t in chunks[0].state_dict().items()}
    state.reset()

    parallel_state.initialize_model_parallel(world, 1)
    _cpu_stand_ins()
    iteration = Path(folder) / f"iter_{K:07d}"
    common = safe_load(iteration / "common.pt")
    model = mcore_model(common["args"], tp=world)
    mcore_optimizer = megatron_core_optimizer(model, common["args"])
    metadata = common["content_metadata"]
    with megatron_core_on_cpu():
        sharded = {"model": model.sharded_state_dict(metadata=metadata)}
        sharded["optimizer"] = mcore_optimizer.sharded_state_dict(sharded, is_loading=True, metadata=metadata)
    sharded["rng_state"] = ShardedObject("rng_state", None, (1, world), (0, rank), replica_id=0)  # get_rng_state's
    loaded = dist_checkpointing.load(sharded, str(iteration), strict=StrictHandling.RAISE_ALL)
    getattr(model, "module", model).load_state_dict(loaded["model"], strict=True)
    mcore_optimizer.load_state_dict(loaded["optimizer"])
    theirs = megatron_core_state(model, mcore_optimizer)
    weights = {n: t.clone() for n, t in getattr(model, "module", model).state_dict().items()
               if not n.endswith("_extra_state")}
    # megatron-core saves what it loaded, as Megatron-LM's save_checkpoint composes it
    again = {k: common[k] for k in ("args", "checkpoint_version", "iteration")}
    again["rng_state"] = ShardedObject("rng_state", loaded["rng_state"], (1, world), (0, rank), replica_id=0)
    (Path(folder) / "megatron_core").mkdir(exist_ok=True)
    save_sharded(Path(folder) / "megatron_core", again, model, mcore_optimizer, _Scheduler(common), metadata)
    parallel_state.destroy_model_parallel()
    return {"ours": ours, "theirs": theirs, "ours_weights": ours_weights, "weights": weights,
            "kind": type(mcore_optimizer).__name__, "rng": loaded["rng_state"]}


class _Scheduler:
    """What save_sharded asks of Megatron-LM's scheduler: its state_dict (ours, from common.pt)."""

    def __init__(self, common):
        self.common = common

    def state_dict(self):
        return self.common["opt_param_scheduler"]


def _entries(folder: Path) -> dict:
    from hf_megatron.checkpoint.torch_dist import SafeReader
    md = SafeReader(str(folder)).read_metadata().state_dict_metadata
    return {k: (tuple(v.size), v.properties.dtype) if hasattr(v, "size") else "bytes" for k, v in md.items()}


@pytest.mark.parametrize("arch, dtype, kind, tp", [
    ("gpt2", "fp32", "FP32Optimizer", 1), ("qwen2", "bf16", "Float16OptimizerWithFloat16Params", 1),
    pytest.param("gpt2", "fp32", "FP32Optimizer", 2, marks=pytest.mark.slow),
    pytest.param("qwen2", "bf16", "Float16OptimizerWithFloat16Params", 2, marks=pytest.mark.slow)])
def test_megatron_core_loads_our_torch_dist_training_checkpoint(arch, dtype, kind, tp, tmp_path):
    """tp 2: our two ranks' shards merged on rank 0; megatron-core's tp-2 model and optimizer load their own
    shards of it (strict), each equal to the shard our rank of the same coordinates held."""
    from hf_megatron.checkpoint.unpickle import safe_load
    for got in run_distributed(_ours_then_megatron_core, tp, (arch, dtype, str(tmp_path))):
        _same_state(got, kind)
    ours_dir, theirs_dir = tmp_path / f"iter_{K:07d}", tmp_path / "megatron_core"
    assert _entries(ours_dir) == _entries(theirs_dir)
    mine, megatron = safe_load(ours_dir / "common.pt"), safe_load(theirs_dir / "common.pt")
    assert set(megatron) <= set(mine) and mine["content_metadata"] == megatron["content_metadata"]
    assert mine["args"].tensor_model_parallel_size == tp
    assert mine["optimizer"].keys() == megatron["optimizer"].keys()
    inner = (lambda entry: entry.get("optimizer", entry))
    assert inner(mine["optimizer"])["state"].keys() == inner(megatron["optimizer"])["state"].keys() == {"common_step"}


def _same_state(got: dict, kind: str) -> None:
    """One rank: megatron-core's loaded weights, moments, step and fp32 main weights are ours."""
    assert got["kind"] == kind
    ours, theirs = got["ours"], got["theirs"]
    assert sorted(ours) == sorted(theirs)
    for name, (step, exp_avg, exp_avg_sq, main) in theirs.items():
        assert step == ours[name][0] == float(K), name
        assert torch.equal(exp_avg, ours[name][1]) and torch.equal(exp_avg_sq, ours[name][2]), name
        assert torch.equal(main, ours[name][3]), name
    assert sorted(got["weights"]) == sorted(got["ours_weights"])
    for name, tensor in got["weights"].items():
        assert torch.equal(tensor, got["ours_weights"][name]), name
    assert got["rng"] and set(got["rng"][0]) >= {"random_rng_state", "torch_rng_state", "rng_tracker_states"}


def _save_and_load_in_layout(rank, world, arch, layout, folder):
    """K steps at `layout`, saved as torch_dist (gathered onto rank 0), loaded back into a fresh model and
    optimizer at the same layout: (this rank's state before, after, RNG entry before, after)."""
    from hf_megatron.parallel import state
    from hf_megatron.training import build_model, build_optimizer, build_scheduler, setup_parallel, split_batch, \
        train_step
    from hf_megatron.training.checkpoint import get_rng_state, load_checkpoint, save_checkpoint
    from tiny import engine_batch, tiny_hf_model
    from training_helpers import make_batches, training_config
    cfg = training_config(layout, bf16=True)
    setup_parallel(cfg)

    def build():
        chunks = build_model(tiny_hf_model(arch), cfg)
        optimizer = build_optimizer(chunks, cfg)
        return chunks, optimizer, build_scheduler(optimizer, cfg)

    chunks, optimizer, scheduler = build()
    for batch in make_batches(K):
        train_step(chunks, optimizer, scheduler, split_batch(engine_batch(batch), cfg))
    save_checkpoint(folder, K, chunks, optimizer, scheduler, ckpt_format="torch_dist")
    before = our_state(chunks[0], optimizer), {n: t.clone() for n, t in chunks[0].state_dict().items()}
    rng_before = get_rng_state()
    torch.manual_seed(1234)  # the load must bring the streams back
    chunks, optimizer, scheduler = build()
    assert load_checkpoint(folder, chunks, optimizer, scheduler) == K
    after = our_state(chunks[0], optimizer), {n: t.clone() for n, t in chunks[0].state_dict().items()}
    state.reset()
    return before, after, rng_before, get_rng_state()


@pytest.mark.parametrize("arch, layout", [("qwen2", {"tp": 2}), pytest.param("gpt2", {"pp": 2}, marks=pytest.mark.slow)])
def test_torch_dist_saved_at_tp_or_pp_loads_back_exactly(arch, layout, tmp_path):
    """Every rank's weights, fp32 main weights, Adam moments, step and RNG streams come back bit for bit
    (tp 2: SwiGLU fc1 and QKV shards merged and split again; pp 2: the stages' layers stacked, the tied
    embedding's last-stage copy read from the embedding); the folder holds one rng_state per (pp, tp) rank."""
    got = run_distributed(_save_and_load_in_layout, 2, (arch, layout, str(tmp_path)))
    for before, after, rng_before, rng_after in got:
        (state_before, weights_before), (state_after, weights_after) = before, after
        assert sorted(weights_before) == sorted(weights_after)
        for name, tensor in weights_before.items():
            assert torch.equal(tensor, weights_after[name]), name
        assert sorted(state_before) == sorted(state_after)
        for name, values in state_before.items():
            assert values[0] == state_after[name][0] == float(K), name
            for a, b in zip(values[1:], state_after[name][1:]):
                assert torch.equal(a, b), name
        # the streams a CPU run draws from (the expert-parallel entry is a CUDA stand-in restore recomputes)
        for key in ("random_rng_state", "np_rng_state", "torch_rng_state", "cpu_rng_tracker_states"):
            assert repr(rng_before[key]) == repr(rng_after[key]), key
        assert repr(rng_before["rng_tracker_states"]["model-parallel-rng"]) == \
            repr(rng_after["rng_tracker_states"]["model-parallel-rng"])
    from hf_megatron.checkpoint.torch_dist import TorchDistCheckpoint
    tp, pp = layout.get("tp", 1), layout.get("pp", 1)
    entries = _entries(tmp_path / f"iter_{K:07d}")
    cells = [(p, t) for p in range(pp) for t in range(tp)]
    assert sorted(n for n in entries if n.startswith("rng_state")) == [f"rng_state/shard_{p}.{t}_{pp}.{tp}"
                                                                      for p, t in cells]
    folder = TorchDistCheckpoint(tmp_path / f"iter_{K:07d}", K)
    for rank, (p, t) in enumerate(cells):  # rank = pp_rank * tp + tp_rank at dp 1: its own list, as saved
        assert repr(folder.read_object(f"rng_state/shard_{p}.{t}_{pp}.{tp}")) == repr([[got[rank][2]]])
    assert entries["decoder.layers.mlp.linear_fc1.weight"][0][0] == 2  # both layers, one global tensor

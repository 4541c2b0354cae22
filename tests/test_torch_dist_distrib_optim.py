"""megatron-core 0.16.1's distributed optimizer inside a torch_dist checkpoint (Megatron-LM's
--ckpt-format torch_dist with --use-distributed-optimizer) resumed by `hf-megatron train --load`.

megatron-core trains its GPTModel K steps under its DDP + DistributedOptimizer on CPU / gloo
(tests/test_megatron_distrib_optim.py's run, dp 1 or 2) and saves iteration K with
`dist_checkpointing.save` as Megatron-LM's save_checkpoint composes it, in either of Megatron-LM's
sharding types:

* dp_reshardable (its default): per grad-buffer bucket the tensors `optimizer.distributed.dp_group_idx_<r>.
  gbuf_idx_<g>.dtype_<(param, grad dtype)>.bucket_idx_<b>.{param,exp_avg,exp_avg_sq}` (the bucket's
  unpadded length, megatron-core's buffer layout), the param groups and scaler as ShardedObjects;
* fully_reshardable: `optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>` at each weight's shape, the
  param groups (with the step) in common.pt.  One bucket only: with several, megatron-core 0.16.1 itself
  cuts these tensors at padded offsets out of its unpadded buffers (it warns "param range exceeds unpadded
  buffer ... data corruption", its issue #504).

Our reader then holds megatron-core's state name by name (its own accessors over the dp ranks' shards)
and `train --load` continues with megatron-core's next two losses.
"""
from __future__ import annotations

import pytest

from dist import run_distributed
from test_megatron_distrib_optim import _megatron_lm_distributed_run, _whole, assert_same_state, our_loaded_optimizer
from test_megatron_optimizer import K, PADDED_VOCAB, our_state, resume_with_train


@pytest.mark.parametrize("sharding, arch, dtype, bucket_size, dp, ours_distributed", [
    ("dp_reshardable", "qwen2", "bf16", 20000, 2, True), ("fully_reshardable", "gpt2", "fp32", None, 1, False),
    pytest.param("dp_reshardable", "gpt2", "fp32", None, 1, False, marks=pytest.mark.slow),
    pytest.param("fully_reshardable", "qwen2", "bf16", None, 2, True, marks=pytest.mark.slow)])
def test_train_resumes_megatron_core_distributed_optimizer_in_torch_dist(sharding, arch, dtype, bucket_size, dp,
                                                                        ours_distributed, tmp_path):
    from hf_megatron.conversion.convert import hf_to_megatron
    from hf_megatron.parallel import state
    from test_convert_helpers import save_hf
    from train_cli import make_workspace
    make_workspace(tmp_path)
    hf_to_megatron(save_hf(tmp_path / "hf", arch, vocab_size=PADDED_VOCAB), tmp_path / "converted", dtype=dtype)
    runs = run_distributed(_megatron_lm_distributed_run, dp, (str(tmp_path), bucket_size, sharding))
    expected, _, buckets = runs[0]
    assert (buckets[0] > 2) == (bucket_size is not None)
    saved = _whole([shards for _, shards, _ in runs])

    _, chunks, optimizer = our_loaded_optimizer(tmp_path / "megatron_lm", arch, dtype, ours_distributed)
    loaded = our_state(chunks[0], optimizer)
    state.reset()
    assert_same_state(loaded, saved)

    ours = resume_with_train(tmp_path, dtype, *(["--use-distributed-optimizer"] if ours_distributed else []))
    # measured (K+1, K+2): fp32 8e-8, 0; qwen2 bf16 dp2 9.6e-7, 4.6e-6 (either sharding), dp1 4.3e-5, 8.3e-6
    tolerance = 1e-6 if dtype == "fp32" else 1e-3  # bf16: two implementations' rounding
    print(f"relative loss differences: {abs(expected[0] - ours[K + 1]) / ours[K + 1]:.1e}, "
          f"{abs(expected[1] - ours[K + 2]) / ours[K + 2]:.1e}")
    assert ours[K + 1] == pytest.approx(expected[0], rel=tolerance)  # the loaded weights
    assert ours[K + 2] == pytest.approx(expected[1], rel=tolerance)  # one update with the loaded moments


def _our_state_at_tp(rank, world, load_dir, arch, distributed):
    """Our reader at tp = world: this rank's optimizer state by name (its TP shards)."""
    from hf_megatron.parallel import state
    from hf_megatron.training import build_model, build_optimizer, setup_parallel
    from hf_megatron.training.checkpoint import load_checkpoint
    from tiny import tiny_hf_model
    from training_helpers import training_config
    cfg = training_config({"tp": world, "zero": distributed})
    setup_parallel(cfg)
    chunks = build_model(tiny_hf_model(arch, vocab_size=TP2_VOCAB), cfg)
    optimizer = build_optimizer(chunks, cfg)
    assert load_checkpoint(load_dir, chunks, optimizer, load_rng=False) == K
    out = our_state(chunks[0], optimizer)
    state.reset()
    return out


TP2_VOCAB = 512  # a multiple of 128 x tp: no padded rows at tp 2 either (Megatron-LM's loss would take them in)


@pytest.mark.slow
def test_dp_reshardable_at_tp2_is_read_per_model_parallel_rank(tmp_path):
    """dp_reshardable keeps one set of bucket tensors per model-parallel rank (`dp_group_idx_<r>`): at tp 2
    each of our tp ranks holds the state megatron-core's rank with its coordinates holds, and the run
    continues with megatron-core's next two losses."""
    from hf_megatron.conversion.convert import hf_to_megatron
    from test_convert_helpers import save_hf
    from test_megatron_optimizer import resume_flags
    from test_reshard_optimizer import losses, run_train
    from train_cli import make_workspace
    make_workspace(tmp_path)
    hf_to_megatron(save_hf(tmp_path / "hf", "qwen2", vocab_size=TP2_VOCAB), tmp_path / "converted", dtype="fp32")
    runs = run_distributed(_megatron_lm_distributed_run, 2, (str(tmp_path), 20000, "dp_reshardable", 2))
    (expected, _, _), theirs = runs[0], [_whole([shards]) for _, shards, _ in runs]
    ours = run_distributed(_our_state_at_tp, 2, (str(tmp_path / "megatron_lm"), "qwen2", True))
    for mine, saved in zip(ours, theirs):
        assert_same_state(mine, saved)
    out = run_train(2, "--load", tmp_path / "megatron_lm", "--train-iters", K + 2, "--tensorboard-dir", tmp_path / "tb",
                    "--tensor-model-parallel-size", 2, "--use-distributed-optimizer", *resume_flags(tmp_path, "fp32"),
                    "--no-load-rng")  # megatron-core's CPU run saves no RNG (args.no_save_rng)
    assert f"iteration      {K + 1}/{K + 2}" in out
    resumed = losses(tmp_path / "tb")
    print(f"relative loss differences: {abs(expected[0] - resumed[K + 1]) / resumed[K + 1]:.1e}, "
          f"{abs(expected[1] - resumed[K + 2]) / resumed[K + 2]:.1e}")
    # measured: 7.6e-8, 0
    assert resumed[K + 1] == pytest.approx(expected[0], rel=1e-6)
    assert resumed[K + 2] == pytest.approx(expected[1], rel=1e-6)

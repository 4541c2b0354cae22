"""megatron-core 0.16.1's distributed optimizer checkpoint (distrib_optim.pt, --ckpt-format torch) resumed by
`hf-megatron train --load`.

megatron-core trains its GPTModel K AdamW steps wrapped as Megatron-LM's `get_model` / `setup_model_and_-
optimizer` do with --use-distributed-optimizer: Float16Module for bf16, then its DistributedDataParallel
(use_distributed_optimizer, grad_reduce_in_fp32 for bf16 as Megatron-LM's --bf16 implies), its
`get_megatron_optimizer` (a ChainedOptimizer around one DistributedOptimizer) and OptimizerParamScheduler;
each step is Megatron-LM's train_step on one global batch (zero_grad_buffer, backward,
finish_grad_sync, step).  The checkpoint is what Megatron-LM's `save_checkpoint` writes for ckpt_format
torch (megatron/training/checkpointing.py at core_v0.16.1): model_optim_rng.pt from `generate_state_dict`
(optimizer entry = `optimizer.state_dict()`, params-free groups with the step) and
`optimizer.save_parameter_state(<rank dir>/distrib_optim.pt)`.  Then `train --load` (our distributed
optimizer, or our plain one) resumes it; its losses at K+1 and K+2 equal megatron-core continuing its own
run on the same samples, and every param's main weight and Adam moments as our reader placed them equal
megatron-core's own (`DistributedOptimizer._get_main_param_and_optimizer_states`), name by name.
`hf-megatron reshard --with-optimizer` reads the file too (its output holds the same state).

Cases: one bucket (Megatron-LM's default: no --overlap-grad-reduce), and --overlap-grad-reduce with a small
--ddp-bucket-size (several buckets: the file drops each bucket's end padding, keeps the 64-element
param alignment inside buckets); megatron-core at dp 1 and at dp 2 (each rank steps its shard,
save_parameter_state gathers them on dp rank 0; its state is compared through every rank's shards),
resumed by ours at dp 1 with either of our optimizers.

The other way: `hf-megatron train --use-distributed-optimizer` (dp 1 in-process, dp 2 under torchrun; fp32
and bf16; one bucket and --overlap-grad-reduce with several) saves iteration K and runs on to K+2;
megatron-core builds its model, DDP and DistributedOptimizer from that checkpoint's args and loads it as
Megatron-LM's load_checkpoint does (model, `optimizer.load_state_dict`, `optimizer.load_parameter_state`,
scheduler), then takes steps K+1 and K+2: its losses equal ours, and its state (through its own
accessors, over the dp ranks' shards) equals, name by name, what our reader takes from the same files.
One more CPU stand-in there (`_with_torch_adam_step`): torch's Adam keeps a per-param "step" that
FusedAdam (Megatron-LM on GPUs) does not, which megatron-core's load_parameter_state cannot fill.

The llama cases are tests/tiny.py's llama with Llama 3.1's RoPE constants (`MEGATRON_LM_EXPRESSIBLE`): Megatron-LM
builds llama3 RoPE with those alone (tests/test_megatron_llama_parity.py), and tiny.py's original context 16
made megatron-core's first loss differ from ours by 9.4e-6 (fp32 dp 2) before any update.

megatron-core on CPU: exactly tests/test_megatron_optimizer.py's patches (`megatron_core_on_cpu` around
building and stepping the optimizer: device='cuda' scalars made on CPU, CUDA type names for CPU tensors;
`_cpu_stand_ins`: torch.cuda.current_device() -> "cpu", which also places DDP's grad buffers on CPU, and
no CUDA RNG fork).  Nothing in DDP or the DistributedOptimizer is patched; its reduce-scatter,
all-gather and gather run on gloo.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dist import run_distributed
from hf_megatron.checkpoint.unpickle import safe_load
from test_megatron_llama_parity import LLAMA31
from test_megatron_optimizer import (GBS, HP, K, PADDED_VOCAB, SEQ, VOCAB, _cpu_stand_ins, mcore_loss, mcore_model,
                                     megatron_core_on_cpu, megatron_core_scheduler, next_two_losses, our_state, param_names,
                                     resume_with_train, write_megatron_lm_iteration)


# tiny.py's model overrides for a model Megatron-LM builds from our args as it is
MEGATRON_LM_EXPRESSIBLE = {"llama": LLAMA31}


def _ddp_and_optimizer(model, args):
    """What Megatron-LM's get_model + get_megatron_optimizer build with --use-distributed-optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=args.bf16,
                                               overlap_grad_reduce=args.overlap_grad_reduce,
                                               bucket_size=args.ddp_bucket_size)
    ddp = DistributedDataParallel(getattr(model, "module", model).config, ddp_config, model)
    config = OptimizerConfig(optimizer="adam", lr=HP["lr"], min_lr=HP["min_lr"], weight_decay=HP["weight_decay"],
                             adam_beta1=HP["beta1"], adam_beta2=HP["beta2"], adam_eps=HP["eps"],
                             clip_grad=HP["clip_grad"], bf16=args.bf16, fp16=args.fp16, params_dtype=args.params_dtype,
                             use_distributed_optimizer=True)
    with megatron_core_on_cpu():
        return ddp, get_megatron_optimizer(config, [ddp])


def _megatron_lm_train_step(ddp, optimizer, scheduler):
    """Megatron-LM's train_step on one global batch [GBS, SEQ + 1], split over the dp ranks (tp ranks see the
    same samples); returns the global batch's loss."""
    from megatron.core import parallel_state
    dp_rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()

    def step(tokens: torch.Tensor) -> float:
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        mine = tokens.chunk(dp)[dp_rank]
        loss = mcore_loss(ddp, mine[:, :-1], mine[:, 1:])
        loss.backward()
        ddp.finish_grad_sync()  # grads averaged over dp (DDP's 1/dp scaling): the global batch's mean
        with megatron_core_on_cpu():
            updated, _, _ = optimizer.step()
        assert updated
        scheduler.step(increment=GBS)
        total = loss.detach().clone()
        torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group())
        return total.item() / dp
    return step


def _megatron_core_shards(model, optimizer) -> dict:
    """{name: (start, numel, main weight, exp_avg, exp_avg_sq, step)}: this dp rank's part of each param,
    through megatron-core's own accessors."""
    (inner,) = optimizer.chained_optimizers
    shards = {}
    for name, p in param_names(model).items():
        if p in inner.model_param_group_index_map:
            tensors, where = inner._get_main_param_and_optimizer_states(p), inner._get_model_param_range_map(p)
            shards[name] = (where["param"].start, p.numel(), *(tensors[k].detach().float().clone().reshape(-1)
                                                                  for k in ("param", "exp_avg", "exp_avg_sq")),
                            float(tensors["step"]))
    return shards


def _whole(runs) -> dict:
    """{name: (step, main weight, exp_avg, exp_avg_sq)}, flat, from every dp rank's shards."""
    saved, steps = {}, {}
    for shards in runs:
        for name, (start, numel, *parts, step) in shards.items():
            whole = saved.setdefault(name, [torch.full((numel,), float("nan")) for _ in parts])
            for target, part in zip(whole, parts):
                target[start:start + part.numel()] = part
            steps.setdefault(name, set()).add(step)
    assert not any(t.isnan().any() for whole in saved.values() for t in whole)
    return {name: (steps[name].pop() if len(steps[name]) == 1 else None, *whole) for name, whole in saved.items()}


def _save_torch_dist(root: Path, args, model, optimizer, scheduler, sharding: str) -> None:
    """Megatron-LM's save_checkpoint with --ckpt-format torch_dist and the distributed optimizer
    (`generate_state_dict`; the model unwrapped, as save_checkpoint does; `_build_sharded_state_dict_metadata`:
    `sharding` 'dp_reshardable' is its default, 'fully_reshardable' with --dist-ckpt-optim-fully-reshardable
    and --distrib-optim-fully-reshardable-mem-efficient, whose gather runs on gloo) -- collective."""
    from test_torch_dist_resume import save_sharded
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                "distrib_optim_sharding_type": sharding, "distrib_optim_fully_reshardable_mem_efficient": True}
    args.ckpt_format, args.iteration, args.consumed_train_samples, args.no_save_rng = "torch_dist", K, K * GBS, True
    folder = root / "megatron_lm" / f"iter_{K:07d}"
    if torch.distributed.get_rank() == 0:
        folder.mkdir(parents=True)
        (root / "megatron_lm" / "latest_checkpointed_iteration.txt").write_text(str(K))
    torch.distributed.barrier()
    save_sharded(folder, {"args": args, "checkpoint_version": 3.0, "iteration": K}, model, optimizer, scheduler,
                 metadata)


def our_loaded_optimizer(load_dir: Path, arch: str, dtype: str, distributed: bool, **load):
    """(cfg, chunks, optimizer): our model and optimizer at dp 1 in this process, iteration K of `load_dir`
    loaded into them."""
    from hf_megatron.training import build_model, build_optimizer, setup_parallel
    from hf_megatron.training.checkpoint import load_checkpoint
    from tiny import tiny_hf_model
    from training_helpers import training_config
    cfg = training_config({"zero": distributed}, bf16=dtype == "bf16")
    setup_parallel(cfg)
    chunks = build_model(tiny_hf_model(arch, vocab_size=PADDED_VOCAB, **MEGATRON_LM_EXPRESSIBLE.get(arch, {})), cfg)
    optimizer = build_optimizer(chunks, cfg)
    assert load_checkpoint(load_dir, chunks, optimizer, load_rng=False, **load) == K
    return cfg, chunks, optimizer


def assert_same_state(ours: dict, theirs: dict) -> None:
    """our_state(...) equals _whole(...) of megatron-core's shards: every name, step K, exact tensors."""
    assert sorted(ours) == sorted(theirs)
    for name, (step, main, exp_avg, exp_avg_sq) in theirs.items():
        assert ours[name][0] == step == float(K), name
        for got, want in zip((ours[name][3], ours[name][1], ours[name][2]), (main, exp_avg, exp_avg_sq)):
            assert torch.equal(got.reshape(-1), want), name


def _megatron_lm_distributed_run(rank, world, root, bucket_size, sharding=None, tp=1):
    """megatron-core trains K steps with the distributed optimizer at tp x dp = world and saves iteration K:
    torch format (`sharding` None) or torch_dist with that distributed-optimizer sharding; then continues."""
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tp, 1)
    _cpu_stand_ins()
    root = Path(root)
    args = safe_load(root / "converted/release/mp_rank_00/model_optim_rng.pt")["args"]
    args.use_distributed_optimizer, args.data_parallel_size, args.tensor_model_parallel_size = True, world // tp, tp
    args.overlap_grad_reduce, args.ddp_bucket_size = bucket_size is not None, bucket_size
    torch.manual_seed(3)
    model = mcore_model(args, tp=tp)
    ddp, optimizer = _ddp_and_optimizer(model, args)
    scheduler, gen = megatron_core_scheduler(optimizer), torch.Generator().manual_seed(5)
    step = _megatron_lm_train_step(ddp, optimizer, scheduler)

    for _ in range(K):
        step(torch.randint(1, VOCAB, (GBS, SEQ + 1), generator=gen))
    buckets = [len(b.buckets) for b in ddp.buffers]
    folder = root / "megatron_lm" / f"iter_{K:07d}" / "mp_rank_00"
    if sharding is not None:
        _save_torch_dist(root, args, model, optimizer, scheduler, sharding)
    else:
        if rank == 0:  # dp rank 0 writes model_optim_rng.pt; the parameter state is gathered there (collective)
            write_megatron_lm_iteration(root, args, ddp, optimizer, scheduler)
        torch.distributed.barrier()
        optimizer.save_parameter_state(str(folder / "distrib_optim.pt"))
    shards = _megatron_core_shards(model, optimizer)

    losses = next_two_losses(root, step, ddp)
    parallel_state.destroy_model_parallel()
    return losses, shards, buckets


@pytest.mark.parametrize("arch, dtype, bucket_size, dp, ours_distributed", [
    ("gpt2", "fp32", None, 1, True), ("qwen2", "bf16", 20000, 1, False),
    ("qwen2", "fp32", 20000, 2, True)])
def test_train_resumes_megatron_core_distrib_optim(arch, dtype, bucket_size, dp, ours_distributed, tmp_path):
    from hf_megatron.conversion.convert import hf_to_megatron
    from test_convert_helpers import save_hf
    from train_cli import make_workspace
    make_workspace(tmp_path)
    hf_to_megatron(save_hf(tmp_path / "hf", arch, vocab_size=PADDED_VOCAB), tmp_path / "converted", dtype=dtype)
    runs = run_distributed(_megatron_lm_distributed_run, dp, (str(tmp_path), bucket_size))
    expected, _, buckets = runs[0]
    saved = _whole([shards for _, shards, _ in runs])  # every param's state, flat
    assert buckets == ([1] if bucket_size is None else [buckets[0]]) and (bucket_size is None or buckets[0] > 2)
    file = safe_load(tmp_path / f"megatron_lm/iter_{K:07d}/mp_rank_00/distrib_optim.pt")
    assert file["buckets_coalesced"] is True and sorted(k for k in file if k != "buckets_coalesced") == [0]

    # what our reader placed is megatron-core's state, name by name, exactly
    from hf_megatron.parallel import state
    from hf_megatron.training import build_optimizer
    from hf_megatron.training.checkpoint import load_checkpoint
    cfg, chunks, optimizer = our_loaded_optimizer(tmp_path / "megatron_lm", arch, dtype, ours_distributed)
    loaded = our_state(chunks[0], optimizer)
    # a file that does not fit this model's layout: one line naming it
    from hf_megatron.errors import CheckpointError
    path = tmp_path / f"megatron_lm/iter_{K:07d}/mp_rank_00/distrib_optim.pt"
    (key, tensors), = file[0].items()
    torch.save({**file, 0: {key: {**tensors, "exp_avg": tensors["exp_avg"][:-1]}}}, path)
    with pytest.raises(CheckpointError, match=r"distrib_optim\.pt: grad buffer 0 exp_avg should be a 1-D tensor of "
                                              rf"{tensors['numel_unpadded']} elements .*, got \({tensors['numel_unpadded'] - 1},\)"):
        load_checkpoint(tmp_path / "megatron_lm", chunks, optimizer, load_rng=False)
    torch.save(file, path)
    resharded = None
    if arch == "gpt2":  # reshard --with-optimizer reads this layout too: its output holds the same state
        from hf_megatron import cli
        assert cli.main(["reshard", "--src", str(tmp_path / f"megatron_lm/iter_{K:07d}"), "--out", str(tmp_path / "re"),
                         "--tp", "1", "--pp", "1", "--with-optimizer", "--no-checkpoint-checksums"]) == 0
        fresh = build_optimizer(chunks, cfg)
        assert load_checkpoint(tmp_path / "re", chunks, fresh, load_rng=False) == K
        resharded = our_state(chunks[0], fresh)
    state.reset()
    for ours in (loaded, resharded) if resharded else (loaded,):
        assert_same_state(ours, saved)

    ours = resume_with_train(tmp_path, dtype, *(["--use-distributed-optimizer"] if ours_distributed else []))
    # measured (K+1, K+2): gpt2 fp32 dp1 8e-8, 0; qwen2 bf16 4.3e-5, 8.3e-6; qwen2 fp32 dp2 0, 8e-8
    tolerance = 1e-6 if dtype == "fp32" else 1e-3  # bf16: two implementations' rounding
    assert ours[K + 1] == pytest.approx(expected[0], rel=tolerance)  # the loaded weights
    assert ours[K + 2] == pytest.approx(expected[1], rel=tolerance)  # one update with the loaded moments


# ---------------------------------------------------------------- the layout rule alone, many bucket sizes

def _megatron_core_buffer_offsets(rank, world, cases):
    """For each (bucket_size, shared embedding): megatron-core's DDP buffer for a fresh tiny GPTModel, and
    where each param lands in save_parameter_state's coalesced tensor (buckets' unpadded lengths
    concatenated) -- from its own param_index_map / bucket_indices / numel_unpadded -- and ours."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from hf_megatron.training.megatron_distrib_optim import buffer_layout
    parallel_state.initialize_model_parallel(1, 1)
    _cpu_stand_ins()
    out = []
    for bucket_size, shared in cases:
        config = TransformerConfig(num_layers=2, hidden_size=40, num_attention_heads=4, use_cpu_initialization=True,
                                   add_bias_linear=True, gradient_accumulation_fusion=False)
        model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=200, max_sequence_length=32)
        params = [p for p in model.parameters() if p.requires_grad]
        alone = {id(model.embedding.word_embeddings.weight)} if shared else set()
        if shared:  # what Megatron-LM marks on a pp > 1 stage holding a tied word embedding
            model.embedding.word_embeddings.weight.shared_embedding = True
        ours = buffer_layout(params, bucket_size, alone)  # before DDP replaces the params' storage
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=bucket_size or 10 ** 12), model)
        (buffer,) = ddp.buffers
        before = [0]
        for bucket in buffer.buckets:
            before.append(before[-1] + bucket.numel_unpadded)
        theirs = {}
        for p in params:
            start, _, b = buffer.param_index_map[p]
            theirs[id(p)] = before[b] + start - buffer.bucket_indices[b][0]
        out.append((ours, (theirs, buffer.numel_unpadded), len(buffer.buckets)))
    parallel_state.destroy_model_parallel()
    return out


def test_buffer_layout_is_megatron_cores_for_any_bucket_size():
    cases = [(None, False), (1, False), (700, False), (5000, False), (20000, True), (None, True), (1, True)]
    results = run_distributed(_megatron_core_buffer_offsets, 1, (cases,))[0]
    for (bucket_size, shared), (ours, theirs, buckets) in zip(cases, results):
        assert ours == theirs, (bucket_size, shared)
    buckets = [b for *_, b in results]
    assert buckets[0] == 1 and buckets[1] > buckets[2] > buckets[3] > 1  # one param per bucket at size 1
    assert buckets[5] == 2  # the shared embedding alone (it is the buffer's last param: reverse order)


# ---------------------------------------------------------------- ours -> megatron-core

def _with_torch_adam_step(optimizer) -> None:
    """A CPU stand-in for Megatron-LM's GPU optimizer.  megatron-core's load_parameter_state copies every
    entry of a param's optimizer state from the file; with apex / TE FusedAdam (Megatron-LM on GPUs)
    those are exp_avg and exp_avg_sq, but torch's Adam (its CPU fallback) also holds "step", which no
    distrib_optim.pt has (megatron-core's own neither), and load_state_dict gave every param the same
    step tensor, which torch's Adam would then increment once per param.  So each param gets its own
    copy of the step load_state_dict set from the param groups, passed along as it stands."""
    (inner,) = optimizer.chained_optimizers
    real = inner._set_main_param_and_optimizer_states

    def with_step(model_param, tensors):
        group_index, group_order = inner.model_param_group_index_map[model_param]
        entry = inner.optimizer.state[inner.optimizer.param_groups[group_index]["params"][group_order]]
        entry["step"] = entry["step"].clone()
        real(model_param, {**tensors, "step": entry["step"]})
    inner._set_main_param_and_optimizer_states = with_step


def _megatron_core_resumes_ours(rank, world, folder, root):
    """Megatron-LM's load_checkpoint (torch format, --use-distributed-optimizer) of our iteration K in
    `folder`: its model, DDP and optimizer built from the checkpoint's args, then model.load_state_dict,
    optimizer.load_state_dict(the optimizer entry), optimizer.load_parameter_state(distrib_optim.pt),
    opt_param_scheduler.load_state_dict; then (its state by its own accessors, its losses at K+1 and K+2)."""
    import copy
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(1, 1)
    _cpu_stand_ins()
    rank_dir = Path(folder) / f"iter_{K:07d}" / "mp_rank_00"
    payload = safe_load(rank_dir / "model_optim_rng.pt")
    args = payload["args"]
    assert args.use_distributed_optimizer and args.data_parallel_size == world
    model = mcore_model(args)
    ddp, optimizer = _ddp_and_optimizer(model, args)
    loaded = getattr(model, "module", model).load_state_dict(payload["model"], strict=False)
    assert not loaded.unexpected_keys and all(k.endswith("_extra_state") for k in loaded.missing_keys)
    _with_torch_adam_step(optimizer)
    # no_grad: an fp32 model's main shards are views of its params, which load_parameter_state copies into
    with megatron_core_on_cpu(), torch.no_grad():
        optimizer.load_state_dict(copy.deepcopy(payload["optimizer"]))
        optimizer.load_parameter_state(str(rank_dir / "distrib_optim.pt"))
    scheduler = megatron_core_scheduler(optimizer)
    scheduler.load_state_dict(payload["opt_param_scheduler"])
    shards = _megatron_core_shards(model, optimizer)
    groups = [(g["wd_mult"], g["lr"], g["weight_decay"]) for g in optimizer.param_groups]
    losses = next_two_losses(Path(root), _megatron_lm_train_step(ddp, optimizer, scheduler), ddp)
    parallel_state.destroy_model_parallel()
    return losses, shards, [len(b.buckets) for b in ddp.buffers], groups


@pytest.mark.parametrize("arch, dtype, dp, bucket_size", [
    ("gpt2", "fp32", 1, None), ("qwen2", "bf16", 2, 20000),
    pytest.param("llama", "fp32", 2, 20000, marks=pytest.mark.slow),
    pytest.param("llama", "bf16", 1, 5000, marks=pytest.mark.slow),
    pytest.param("gpt2", "bf16", 2, None, marks=pytest.mark.slow)])
def test_megatron_core_resumes_our_distributed_optimizer_checkpoint(arch, dtype, dp, bucket_size, tmp_path):
    """`hf-megatron train --use-distributed-optimizer` saves iteration K and goes on to K+2; megatron-core
    loads iteration K as Megatron-LM does and takes the same two steps: its losses are ours, and what it
    loaded is, param by param, the state our reader (checked above against megatron-core's own files)
    takes from the same files."""
    from hf_megatron.parallel import state
    from test_convert_helpers import save_hf
    from test_megatron_optimizer import resume_flags
    from test_reshard_optimizer import losses, run_train
    from train_cli import make_workspace
    make_workspace(tmp_path)
    save_hf(tmp_path / "hf", arch, vocab_size=PADDED_VOCAB, **MEGATRON_LM_EXPRESSIBLE.get(arch, {}))
    save = tmp_path / "ours"
    overlap = ["--overlap-grad-reduce", "--ddp-bucket-size", bucket_size] if bucket_size else []
    run_train(dp, "--hf-model", tmp_path / "hf", *resume_flags(tmp_path, dtype), "--train-iters", K + 2,
              "--use-distributed-optimizer", *overlap, "--save", save, "--save-interval", K,
              "--tensorboard-dir", save / "tb")
    ours = losses(save / "tb")
    runs = run_distributed(_megatron_core_resumes_ours, dp, (str(save), str(tmp_path)))
    expected, _, buckets, groups = runs[0]
    assert (buckets[0] > 2) == (bucket_size is not None)  # several buckets, alignment gaps between them
    assert [wd for wd, *_ in groups] == [1.0, 0.0]
    assert all(weight_decay == (HP["weight_decay"] if wd else 0.0) for wd, _, weight_decay in groups)
    theirs = _whole([shards for _, shards, *_ in runs])
    _, chunks, optimizer = our_loaded_optimizer(save, arch, dtype, distributed=False, iteration=K)
    mine = our_state(chunks[0], optimizer)
    state.reset()
    assert_same_state(mine, theirs)

    # measured (K+1, K+2): gpt2 fp32 dp1 8e-8, 0; qwen2 bf16 dp2 1.1e-5, 2.6e-5; llama fp32 dp2 8e-8, 0
    # (9.4e-6 at K+1 with tiny.py's rope); llama bf16 dp1 4.8e-6, 6.7e-6; gpt2 bf16 dp2 9.1e-6, 1.0e-6
    tolerance = 1e-6 if dtype == "fp32" else 1e-3  # bf16: two implementations' rounding
    print(f"relative loss differences: {abs(expected[0] - ours[K + 1]) / ours[K + 1]:.1e}, "
          f"{abs(expected[1] - ours[K + 2]) / ours[K + 2]:.1e}")
    assert expected[0] == pytest.approx(ours[K + 1], rel=tolerance)  # the loaded weights
    assert expected[1] == pytest.approx(ours[K + 2], rel=tolerance)  # one update with the loaded moments

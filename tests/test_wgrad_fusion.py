"""--gradient-accumulation-fusion (parallel/wgrad.py) changes where the weight gradient is summed,
not what: fp32 on CPU, fusion on vs off, the per-step losses, grad norms and every param's fp32
main grad agree within rel 1e-6 (the fused GEMM adds dY^T X into main_grad in one addmm instead of
mm + add: a different float order, so not bit equality) over a few steps of 4 micro batches, in
each layout: tp1, tp2 + SP, pp2, dp2 with --overlap-grad-reduce and small buckets, full
recompute, regional compile.  The unfused path itself is checked against transformers by
tests/test_training_parity.py.
"""
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from dist import run_distributed
from tiny import engine_batch, rel_err, tiny_hf_model
from training_helpers import layer_kwargs, make_batches, training_config

from hf_megatron.parallel import wgrad

TOL = 1e-6
STEPS = 3
SMALL_BUCKETS = 3000  # elements: dozens of buckets, launched one by one during backward with overlap


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- the op itself
@pytest.mark.parametrize("bias", [True, False])
def test_fused_linear_matches_autograd_and_returns_a_placeholder(bias):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(7, 5, generator=gen, requires_grad=True)
    b = torch.randn(7, generator=gen, requires_grad=True) if bias else None
    x = torch.randn(3, 2, 5, generator=gen, requires_grad=True)
    dy = torch.randn(3, 2, 7, generator=gen)
    ref = F.linear(x, weight, b)
    ref_grads = torch.autograd.grad(ref, [x, weight] + ([b] if bias else []), dy)
    earlier = torch.randn(7, 5, generator=gen)  # what earlier micro batches left in main_grad
    weight.main_grad = earlier.clone()
    x2 = x.detach().clone().requires_grad_()
    out = wgrad.linear(x2, weight, b)
    assert torch.equal(out, ref)
    out.backward(dy)
    assert rel_err(weight.main_grad, earlier + ref_grads[1]) <= TOL
    assert rel_err(x2.grad, ref_grads[0]) <= TOL
    if bias:
        assert rel_err(b.grad, ref_grads[2]) <= TOL
    assert wgrad.is_placeholder(weight.grad)  # stolen by AccumulateGrad as is: a view of the scratch
    assert not wgrad.is_placeholder(x2.grad) and not wgrad.is_placeholder(torch.zeros(7, 5))
    with torch.no_grad():  # no grad, or no main_grad: a plain linear
        assert torch.equal(wgrad.linear(x, weight, b), ref)
    del weight.main_grad
    weight.grad = None
    wgrad.linear(x2, weight, b).backward(dy)
    assert rel_err(weight.grad, ref_grads[1]) <= TOL and not wgrad.is_placeholder(weight.grad)


def test_fused_linear_compiles_without_graph_break():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(6, 4, generator=gen, requires_grad=True)
    weight.main_grad = torch.zeros(6, 4)
    x = torch.randn(5, 4, generator=gen, requires_grad=True)
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(lambda t: wgrad.linear(t, weight).square().sum(), backend=counter, fullgraph=True)
    fn(x).backward()
    fn(x).backward()  # the second call accumulates on top
    expected = 2 * torch.autograd.grad(F.linear(x, weight).square().sum(), weight)[0]
    assert counter.frame_count == 1
    assert rel_err(weight.main_grad, expected) <= TOL


def test_megatron_flags_switch_fusion_on_and_off():
    import argparse
    from hf_megatron.commands.flags import add_flags, configs_from_args
    from hf_megatron.training import TrainingConfig
    parser = argparse.ArgumentParser()
    add_flags(parser, TrainingConfig)
    for argv, on in (([], False), (["--gradient-accumulation-fusion"], True),
                     (["--no-gradient-accumulation-fusion"], False)):  # Megatron-LM's own spelling
        config, = configs_from_args(parser.parse_args(argv), TrainingConfig)
        assert config.gradient_accumulation_fusion is on, argv


# ----------------------------------------------------------------------------- training runs
def recorded_run(arch: str, layout: dict, batches, fusion: bool, keep_alive: list, compile=False,
                 device: str = "cpu", hf_overrides: dict | None = None, **extra) -> dict:
    """Train len(batches) steps; losses, grad norms and this rank's main grads after every step."""
    from hf_megatron.parallel import state
    from hf_megatron.training import build_model, build_optimizer, setup_parallel, split_batch, train_step
    cfg = training_config(layout, gradient_accumulation_fusion=fusion, **extra)
    setup_parallel(cfg)
    try:
        hf = tiny_hf_model(arch, **layer_kwargs(arch), **(hf_overrides or {}))
        chunks = build_model(hf, cfg, compile=compile, device=device)
        keep_alive.append(chunks)  # the pipeline caches schedules by chunk id: no id reuse
        optimizer = build_optimizer(chunks, cfg)
        buffer, finish, early = optimizer.grad_buffer, optimizer.grad_buffer.finish, []

        def finish_counting():  # with overlap, buckets whose params' hooks all fired are launched already
            early.append(sum(b.launched for b in buffer.buckets))
            finish()
        buffer.finish = finish_counting
        named = [(f"{i}.{n}", p) for i, c in enumerate(chunks) for n, p in c.named_parameters()]
        losses, norms, grads = [], [], []
        for batch in batches:
            micro_batches = split_batch({k: v.to(device) for k, v in engine_batch(batch).items()}, cfg)
            stats = train_step(chunks, optimizer, None, micro_batches)
            losses.append(stats["loss"])
            norms.append(stats["grad_norm"])
            grads.append({n: p.main_grad.detach().cpu().clone() for n, p in named})
        fused = sum(wgrad.is_fused(m) for c in chunks for m in c.modules())
        return {"losses": losses, "norms": norms, "grads": grads, "fused_modules": fused, "early": early,
                "buckets": len(buffer.buckets)}
    finally:
        state.reset()


def _assert_close(fused: dict, plain: dict, label: str) -> None:
    assert fused["fused_modules"] > 0 and plain["fused_modules"] == 0, label
    for ours, ref in zip(fused["losses"] + fused["norms"], plain["losses"] + plain["norms"]):
        assert abs(ours - ref) <= TOL * abs(ref), label
    for step, (ours, ref) in enumerate(zip(fused["grads"], plain["grads"])):
        for name, grad in ref.items():
            assert rel_err(ours[name], grad) <= TOL, f"{label} step {step}: {name}"
    assert len(set(plain["losses"])) == len(plain["losses"]), label  # training moves
    assert fused["early"] == plain["early"], label  # the placeholder dW keeps overlap's readiness count
    if "overlap_grad_reduce" in label:
        assert set(plain["early"]) == {plain["buckets"]} and plain["buckets"] > 10, label


def _pairs(rank, world, jobs, batches):
    keep_alive = []
    return [(recorded_run(arch, layout, batches, True, keep_alive, **extra),
             recorded_run(arch, layout, batches, False, keep_alive, **extra)) for arch, layout, extra in jobs]


def _check_pairs(results, jobs):
    for rank, per_job in enumerate(results):
        for (arch, layout, extra), (fused, plain) in zip(jobs, per_job):
            _assert_close(fused, plain, f"{arch} {layout} {extra} rank {rank}")


SINGLE = [("llama", {}, {}), ("gpt2", {}, {"recompute_granularity": "full"})]
SINGLE_SLOW = [("gpt2", {}, {}), ("llama", {}, {"recompute_granularity": "full"}),
               ("llama", {}, {"recompute_granularity": "selective"})]
OVERLAP = {"overlap_grad_reduce": True, "ddp_bucket_size": SMALL_BUCKETS}
DIST = [("llama", {"tp": 2, "sp": True}, {}), ("gpt2", {"pp": 2}, {}), ("llama", {"dp": 2}, OVERLAP)]
DIST_SLOW = [("gpt2", {"tp": 2, "sp": True}, {}), ("llama", {"tp": 2}, {}), ("llama", {"pp": 2, "vpp": 2}, {}),
             ("gpt2", {"dp": 2}, OVERLAP), ("llama", {"dp": 2, "zero": True}, {**OVERLAP, "overlap_param_gather": True}),
             ("llama", {"tp": 2, "sp": True}, {"recompute_granularity": "full"})]


def test_fusion_trains_like_plain_tp1_and_recompute():
    _check_pairs([_pairs(0, 1, SINGLE, make_batches(STEPS))], SINGLE)


def test_fusion_trains_like_plain_tp2_sp_pp2_dp2_overlap():
    _check_pairs(run_distributed(_pairs, 2, (DIST, make_batches(STEPS))), DIST)


@pytest.mark.slow
def test_fusion_trains_like_plain_more_layouts():
    _check_pairs([_pairs(0, 1, SINGLE_SLOW, make_batches(STEPS))], SINGLE_SLOW)
    _check_pairs(run_distributed(_pairs, 2, (DIST_SLOW, make_batches(STEPS))), DIST_SLOW)


@pytest.mark.parametrize("recompute", [pytest.param(None, marks=pytest.mark.slow), "full"])
def test_compiled_fusion_trains_like_eager_plain(recompute):
    counter = CompileCounterWithBackend("aot_eager")
    keep_alive, batches = [], make_batches(STEPS)
    extra = {"recompute_granularity": recompute}
    fused = recorded_run("llama", {}, batches, True, keep_alive, compile={"backend": counter}, **extra)
    assert counter.frame_count == 2  # one graph for the layers, one for the loss: no graph break
    _assert_close(fused, recorded_run("llama", {}, batches, False, keep_alive, **extra), f"compiled {recompute}")


@pytest.mark.slow
def test_inductor_compiled_fusion_trains_like_compiled_plain():
    keep_alive, batches = [], make_batches(STEPS)  # against the inductor-compiled plain run: inductor
    # itself moves the numbers by ~1e-6 (tests/test_compile.py checks it against eager at 1e-5)
    _assert_close(recorded_run("gpt2", {}, batches, True, keep_alive, compile=True),
                  recorded_run("gpt2", {}, batches, False, keep_alive, compile=True), "inductor")

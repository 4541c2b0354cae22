"""--overlap-grad-reduce / --overlap-param-gather change when the dp collectives run, not what they
compute: 20 training steps (tests/training_helpers.py: tiny gpt2 / llama, 4 micro batches per dp
rank, clipping active) with small buckets and overlap on end with the same losses, grad norms and
weights, bit for bit, as the run with overlap off and one bucket.  (dp = 2: every element is
a + b in either case; the TP, tied-embedding and norm reductions keep their order.)

Also: the dp collectives of one step are one per bucket (counted by wrapping torch.distributed),
launched inside backward with overlap and after it without; and the distributed optimizer keeps
1/dp of the Adam state and tracks the plain optimizer's numbers (rel 1e-6: only its grad-norm
summation order differs).
"""
import pytest
import torch

from dist import run_distributed
from tiny import rel_err
from training_helpers import make_batches, our_run

SMALL_BUCKETS = 3000  # elements: the tiny models' ~110k params fall into dozens of buckets
OVERLAP = dict(overlap_grad_reduce=True, ddp_bucket_size=SMALL_BUCKETS)


def _pairs(rank, world, jobs, batches):
    """Each (arch, layout, extra[, other layout]) job run twice: plain (overlap off, the same
    bucket size), then with `extra` (and the other layout, when given)."""
    keep_alive, out = [], []
    for arch, layout, extra, *other in jobs:
        plain = our_run(arch, layout, batches, keep_alive,
                        **{k: v for k, v in extra.items() if not k.startswith("overlap")})
        overlapped = our_run(arch, other[0] if other else layout, batches, keep_alive, **extra)
        out.append((plain, overlapped))
    return out


def _assert_identical(results, jobs):
    for j, (arch, layout, extra, *_) in enumerate(jobs):
        for rank, per_job in enumerate(results):
            plain, overlapped = per_job[j]
            label = f"{arch} {layout} {extra} rank {rank}"
            assert overlapped["losses"] == plain["losses"], label
            assert [s["grad_norm"] for s in overlapped["stats"]] == [s["grad_norm"] for s in plain["stats"]], label
            for name, weight in plain["state"].items():
                assert torch.equal(overlapped["state"][name], weight), f"{label}: {name}"
            assert len(set(plain["losses"])) == len(plain["losses"]), label  # training moves


DP2 = [("gpt2", {"dp": 2}, OVERLAP),
       ("llama", {"dp": 2, "zero": True}, {**OVERLAP, "overlap_param_gather": True})]


COUNT_CASES = [({"dp": 2}, {}), ({"dp": 2}, OVERLAP), ({"dp": 2, "zero": True}, OVERLAP),
               ({"dp": 2, "zero": True}, {**OVERLAP, "overlap_param_gather": True})]


def _dp2_worker(rank, world, batches):
    return {"pairs": _pairs(rank, world, DP2, batches), "counts": _count_collectives(rank, world, COUNT_CASES)}


@pytest.fixture(scope="module")
def dp2_results():
    return run_distributed(_dp2_worker, 2, (make_batches(),))  # one spawn for the two tests below


def test_dp2_overlap_equals_plain(dp2_results):
    _assert_identical([r["pairs"] for r in dp2_results], DP2)


@pytest.mark.slow
def test_distributed_optimizer_tracks_plain_optimizer():
    jobs = [("llama", {"dp": 2}, {}, {"dp": 2, "zero": True})]
    results = run_distributed(_pairs, 2, (jobs, make_batches()))
    for per_job in results:
        plain, sharded = per_job[0]
        assert 0 < sharded["adam_state_numel"] <= plain["param_numel"] / 2 + 2 * 64
        for ours, ref in zip(sharded["losses"], plain["losses"]):
            assert abs(ours - ref) <= 1e-6 * abs(ref)
        for name, weight in plain["state"].items():
            assert rel_err(sharded["state"][name], weight) <= 1e-6, name
    adam = [per_job[0][1]["adam_state_numel"] for per_job in results]
    assert sum(adam) == results[0][0][0]["param_numel"]  # the shards cover every param once


LAYOUTS_4 = [("gpt2", {"tp": 2, "dp": 2, "sp": True}, OVERLAP),
             ("gpt2", {"pp": 2, "dp": 2}, OVERLAP),  # tied embedding across stages: its own bucket
             ("llama", {"pp": 2, "dp": 2, "zero": True}, {**OVERLAP, "overlap_param_gather": True}),
             ("gpt2", {"tp": 2, "dp": 2, "sp": True, "zero": True}, {**OVERLAP, "overlap_param_gather": True}),
             ("llama", {"pp": 2, "vpp": 2, "dp": 2, "zero": True}, {**OVERLAP, "overlap_param_gather": True})]
LAYOUTS_8 = [("gpt2", {"tp": 2, "pp": 2, "dp": 2, "sp": True}, OVERLAP),
             ("gpt2", {"tp": 2, "pp": 2, "dp": 2, "sp": True, "zero": True},
              {**OVERLAP, "overlap_param_gather": True})]


@pytest.mark.slow
def test_four_process_layouts_overlap_equals_plain():
    _assert_identical(run_distributed(_pairs, 4, (LAYOUTS_4, make_batches())), LAYOUTS_4)


@pytest.mark.slow
def test_tp2_pp2_dp2_overlap_equals_plain():
    _assert_identical(run_distributed(_pairs, 8, (LAYOUTS_8, make_batches())), LAYOUTS_8)


# ----------------------------------------------------------------------------- collectives per step
def _count_collectives(rank, world, cases):
    import torch.distributed as dist

    calls, originals = [], {}

    def wrap(name):  # (torch < 2.13 has no *_single names)
        if not hasattr(dist, name):
            return
        original = originals[name] = getattr(dist, name)

        def counted(*args, **kwargs):
            group = kwargs.get("group")
            calls.append((name, group, torch._C._current_autograd_node() is not None))  # inside backward?
            return original(*args, **kwargs)
        setattr(dist, name, counted)

    for name in ("all_reduce", "reduce_scatter_single", "all_gather_single", "broadcast", "reduce_scatter_tensor",
                 "all_gather_into_tensor", "all_gather"):
        wrap(name)
    try:
        return _steps_counted(cases, calls)
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _steps_counted(cases, calls):
    from hf_megatron.parallel import state
    from hf_megatron.training import build_model, build_optimizer, build_scheduler, evaluate, setup_parallel, \
        split_batch, train_step
    from tiny import engine_batch, tiny_hf_model
    from training_helpers import training_config

    out = []
    for layout, extra in cases:
        cfg = training_config(layout, **extra)
        setup_parallel(cfg)
        chunks = build_model(tiny_hf_model("gpt2", n_layer=4), cfg)
        optimizer = build_optimizer(chunks, cfg)
        scheduler = build_scheduler(optimizer, cfg)
        batch = split_batch(engine_batch(make_batches(2)[0]), cfg)
        train_step(chunks, optimizer, scheduler, batch)  # warm-up (first-step state)
        dp = state.get_state().group("dp")
        calls.clear()
        train_step(chunks, optimizer, scheduler, batch)
        on_dp = [(name, in_backward) for name, group, in_backward in calls if group is dp]
        buckets = optimizer.grad_buffer.buckets
        in_flight = sum(b.gather_work is not None for b in buckets)  # overlap_param_gather: until a forward
        evaluate(chunks, batch)
        out.append({"calls": on_dp, "buckets": len(buckets), "params": len(optimizer.model_params),
                    "gathers_in_flight": (in_flight, sum(b.gather_work is not None for b in buckets))})
        state.reset()
    return out


def test_one_dp_collective_per_bucket_per_step(dp2_results):
    for result in (r["counts"] for r in dp2_results):
        plain, overlap, sharded, gathered = result
        assert plain["buckets"] == 1 and plain["params"] > 40  # default bucket: the whole tiny model
        assert 10 < overlap["buckets"] < overlap["params"]
        # dp group per step: token count + loss sum all-reduces, then one collective per bucket
        assert plain["calls"] == [("all_reduce", False)] * 3
        grad_reduces = [c for c in overlap["calls"] if c[1]]
        assert grad_reduces == [("all_reduce", True)] * overlap["buckets"]  # every bucket launched in backward
        assert len(overlap["calls"]) == overlap["buckets"] + 2
        for run in (sharded, gathered):
            # torch 2.13 names them *_single; before, reduce_scatter_tensor / all_gather_into_tensor
            names = [{"reduce_scatter_tensor": "reduce_scatter_single", "all_gather_into_tensor": "all_gather_single"}
                     .get(name, name) for name, _ in run["calls"]]
            assert names.count("reduce_scatter_single") == run["buckets"] == overlap["buckets"]
            assert names.count("all_gather_single") == run["buckets"]
            assert names.count("all_reduce") == 3  # tokens, loss sum, squared grad norm over the shards
            assert all(in_backward for name, in_backward in run["calls"] if name.startswith("reduce_scatter"))
        assert sharded["gathers_in_flight"] == (0, 0)  # all-gathers waited for in the step
        assert gathered["gathers_in_flight"] == (gathered["buckets"], 0)  # left running; the forward waited

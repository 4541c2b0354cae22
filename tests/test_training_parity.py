"""20 training steps in every tp/pp/dp layout == plain transformers + torch AdamW (fp32, CPU).

Reference (tests/training_helpers.py): the transformers model trained with torch's AdamW, torch's
clip_grad_norm_ and megatron-core's OptimizerParamScheduler (warmup 3, cosine to min_lr), the
global batch of 8 run as 4 micro batches of 2, loss normalised over the global batch's tokens.

Which layout runs where (world size -> arch: layouts (tp, pp, dp); +sp sequence parallel,
+zero distributed optimizer, vpp=2 interleaved):
    1 process (in the test process): llama and gpt2 (1,1,1)
    2 processes, one spawn: llama (2,1,1)+sp, (1,1,2)+zero, (1,2,1) vpp=2
                            gpt2  (2,1,1), (1,2,1), (1,1,2)
    4 processes, one spawn: llama (2,2,1)+sp, (1,2,2)
                            gpt2  (1,2,2)+zero, (2,2,1)+sp vpp=2
Every run also checks: the reported global grad norm (before clipping) equals torch's
clip_grad_norm_ on the HF model (TP-replicated params and tied embeddings counted once), dp
replicas end bit-identical, and a tied output-layer copy on the last stage equals the embedding.

Tolerances (fp32).  Loss: relative 1e-5 at every step -- the layouts differ only in summation
order (TP partial sums, dp/micro-batch splits), about 1e-7 relative per step, and 20 Adam steps
on these tiny models keep it well under 1e-5 (observed <= ~2e-7).  Weights: relative error
(||a-b|| / ||b|| per tensor) <= 2e-4.  Looser than the loss because Adam divides by sqrt(v):
entries whose true gradient is ~0 -- e.g. attention key biases, whose exact gradient is zero
since softmax is shift-invariant -- take lr-sized steps driven by rounding noise, so those
tensors agree only to ~5e-5 even between transformers and our single process.
"""
import pytest

from dist import run_distributed
from tiny import rel_err
from training_helpers import HP, layer_kwargs, make_batches, merge_ranks, our_run, reference_run, to_hf, train_layouts

LOSS_TOL, NORM_TOL, WEIGHT_TOL = 1e-5, 1e-4, 2e-4
JOBS_2 = [("llama", {"tp": 2, "sp": True}), ("llama", {"dp": 2, "zero": True}), ("llama", {"pp": 2, "vpp": 2}),
          ("gpt2", {"tp": 2}), ("gpt2", {"pp": 2}), ("gpt2", {"dp": 2})]
JOBS_4 = [("llama", {"tp": 2, "pp": 2, "sp": True}), ("llama", {"pp": 2, "dp": 2}),
          ("gpt2", {"pp": 2, "dp": 2, "zero": True}), ("gpt2", {"tp": 2, "pp": 2, "vpp": 2, "sp": True}),
          ("llama", {"tp": 2, "dp": 2, "sp": True, "zero": True})]  # also test_layouts_3d's (slow there)

_REFERENCE = {}


def reference(arch):
    if arch not in _REFERENCE:
        batches = make_batches()
        _REFERENCE[arch] = (batches,) + reference_run(arch, batches, **layer_kwargs(arch))
    return _REFERENCE[arch]


def check_against_reference(arch, per_rank, label):
    batches, ref_losses, ref_norms, ref_weights = reference(arch)
    for step, (ours, ref) in enumerate(zip(per_rank[0]["losses"], ref_losses)):
        assert abs(ours - ref) <= LOSS_TOL * abs(ref), f"{label}: step {step} loss {ours} vs {ref}"
    # the global grad norm counts TP-replicated params and the tied embedding once
    # (step 0, identical weights: summation order only; later steps also see the weights' drift)
    for step, (stats, ref) in enumerate(zip(per_rank[0]["stats"], ref_norms)):
        tol = 1e-6 if step == 0 else NORM_TOL
        assert abs(stats["grad_norm"] - ref) <= tol * ref, f"{label}: step {step} norm {stats['grad_norm']} vs {ref}"
    assert sum(n > HP["clip_grad"] for n in ref_norms) >= 5, "clipping should be active on some steps"
    for r in per_rank[1:]:  # every rank reports the same loss
        assert r["losses"] == per_rank[0]["losses"], label
    config = per_rank[0]["config"]
    full = merge_ranks([r["state"] for r in per_rank], [r["coords"] for r in per_rank], config)
    tied_copy = full.pop("output_layer.weight(tied copy)", None)
    if tied_copy is not None:  # the last stage's copy of tied embeddings took the same steps
        assert rel_err(tied_copy, full["embedding.word_embeddings.weight"]) <= WEIGHT_TOL, label
    ours = to_hf(full, config)
    expected = {k: v for k, v in ref_weights.items() if k in ours}
    assert set(ours) | {"lm_head.weight"} >= set(ref_weights), label
    for name, weight in expected.items():
        assert rel_err(ours[name], weight) <= WEIGHT_TOL, f"{label}: {name} {rel_err(ours[name], weight):.2e}"
    # dp replicas hold identical weights
    for r in per_rank:
        twin = next(o for o in per_rank if o["coords"] | {"dp": 0} == r["coords"] | {"dp": 0})
        for name in r["state"]:
            assert (r["state"][name] == twin["state"][name]).all(), f"{label}: dp replicas differ on {name}"


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_single_process_matches_transformers(arch):
    batches = reference(arch)[0]
    ours = our_run(arch, {}, batches)
    check_against_reference(arch, [ours], f"{arch} (1,1,1)")
    assert ours["stats"][0]["lr"] == 0.0 and ours["stats"][3]["lr"] == pytest.approx(3e-3)  # warmup


def _check_jobs(jobs, results):
    for j, (arch, layout) in enumerate(jobs):
        per_rank = [rank_results[j] for rank_results in results]
        check_against_reference(arch, per_rank, f"{arch} {layout}")
        for r in per_rank:
            if layout.get("zero"):  # ZeRO-1: each dp rank keeps Adam moments for its share only
                assert 0 < r["adam_state_numel"] < 0.75 * r["param_numel"], layout
            else:
                assert r["adam_state_numel"] == r["param_numel"], layout
        if layout.get("zero"):
            for r in per_rank:
                twins = [o for o in per_rank if o["coords"] | {"dp": 0} == r["coords"] | {"dp": 0}]
                assert sum(o["adam_state_numel"] for o in twins) == r["param_numel"], layout


def test_two_process_layouts_match_transformers():
    results = run_distributed(train_layouts, 2, (JOBS_2, make_batches()))
    _check_jobs(JOBS_2, results)


def test_four_process_layouts_match_transformers():
    results = run_distributed(train_layouts, 4, (JOBS_4, make_batches()))
    _check_jobs(JOBS_4, results)

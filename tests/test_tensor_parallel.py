"""Tensor and sequence parallelism on CPU (gloo): logits, loss and every gradient equal the
single-process transformers model (fp32, relative error <= 1e-5)."""
import pytest
import torch

from dist import run_distributed
from tiny import VOCAB, hf_grads_from_mcore, hf_reference, local_grads, merge_shards, rel_err, tiny_hf_model

TOL = 1e-5
# GQA with 4 query groups so that tp=4 still holds whole groups
CASES = {"llama": dict(num_attention_heads=8, num_key_value_heads=4), "gpt2": {}}


def _batch():
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[1, :4] = -100
    return ids, labels


def _tp_worker(rank, world):
    import hf_megatron
    from hf_megatron.parallel import random as prandom
    from hf_megatron.parallel import state
    from hf_megatron.training.trainer import sync_sequence_parallel_grads

    state.initialize(tp=world)
    results = {}
    for arch, overrides in CASES.items():
        for sp in (False, True):
            model = hf_megatron.from_pretrained(tiny_hf_model(arch, **overrides), sequence_parallel=sp)
            ids, labels = _batch()
            out = model(ids, labels=labels)
            out.loss.backward()
            sync_sequence_parallel_grads(model.parameters())  # SP: norm grads come from a sequence shard
            results[(arch, sp)] = (out.logits, out.loss, local_grads(model))
    prandom.model_parallel_seed(1234)
    with prandom.tp_rng():
        tp_draw = torch.rand(4)
    results["rng"] = (tp_draw, torch.rand(4))
    return results


def _reference(arch):
    out, grads = hf_reference(arch, *_batch(), **CASES[arch])
    return out, grads, hf_megatron_config(tiny_hf_model(arch, **CASES[arch]))


def hf_megatron_config(hf):
    from hf_megatron import ModelConfig
    return ModelConfig.from_hf(hf.config)


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_and_sequence_parallel_match_single_process(world):
    per_rank = run_distributed(_tp_worker, world)
    for arch in CASES:
        ref, ref_grads, config = _reference(arch)
        for sp in (False, True):
            for rank_result in per_rank:
                logits, loss, _ = rank_result[(arch, sp)]
                assert rel_err(logits, ref.logits) <= TOL, (arch, sp)
                assert abs(loss.item() - ref.loss.item()) <= TOL * ref.loss.item()
            grads = hf_grads_from_mcore(merge_shards([r[(arch, sp)][2] for r in per_rank], config), config)
            assert set(grads) == set(ref_grads)
            for name, grad in ref_grads.items():
                assert rel_err(grads[name], grad) <= TOL, (arch, sp, name)
    # dropout streams: the tensor-parallel stream differs across TP ranks, the default one agrees
    tp_draws = [r["rng"][0] for r in per_rank]
    default_draws = [r["rng"][1] for r in per_rank]
    assert not torch.equal(tp_draws[0], tp_draws[1])
    assert all(torch.equal(default_draws[0], d) for d in default_draws)


def _vocab_worker(rank, world):
    import hf_megatron
    from hf_megatron.parallel import state

    state.initialize(tp=world)
    hf = tiny_hf_model("gpt2", vocab_size=50257, n_positions=32)
    model = hf_megatron.from_pretrained(hf)
    ids = torch.randint(0, 50257, (1, 8), generator=torch.Generator().manual_seed(5))
    loss = model(ids, labels=ids).loss.detach()
    # poison the padded rows (global rows >= 50257): the loss must not move
    emb = model.embedding.word_embeddings
    with torch.no_grad():
        rows = torch.arange(emb.vocab_start, emb.vocab_end)
        emb.weight[rows >= 50257] = 1e4
    poisoned = model(ids, labels=ids).loss.detach()
    return loss, poisoned, emb.weight.shape[0] * world


def test_vocab_not_divisible_by_tp_is_padded_and_padding_never_changes_the_loss():
    hf = tiny_hf_model("gpt2", vocab_size=50257, n_positions=32)
    ids = torch.randint(0, 50257, (1, 8), generator=torch.Generator().manual_seed(5))
    ref = hf(input_ids=ids, labels=ids).loss
    results = run_distributed(_vocab_worker, 2)
    for loss, poisoned, padded in results:
        assert padded == 50432  # 50257 rounded up to a multiple of 128 * tp(2)
        assert abs(loss.item() - ref.item()) <= TOL * ref.item()
        assert poisoned.item() == loss.item()


def test_world_size_that_does_not_fit_fails_before_any_work():
    from hf_megatron.parallel import ParallelConfigError, state

    with pytest.raises(ParallelConfigError, match=r"world size 1 is not divisible by tp\(2\)"):
        state.initialize(tp=2)
    with pytest.raises(ParallelConfigError, match=r"world size 8 is not divisible by tp\(3\)"):
        state.rank_grid(8, tp=3)
    assert state.get_state().tp == 1  # nothing was half-initialised


def test_rank_grid_is_megatron_order():
    from hf_megatron.parallel import state

    grid = state.rank_grid(8, tp=2, pp=2)  # dp inferred = 2
    assert state.groups_along(grid, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert state.groups_along(grid, "dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert state.groups_along(grid, "pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_tp_larger_than_query_groups_is_a_clear_error():
    import hf_megatron
    from hf_megatron.parallel.parallelize import check_tensor_parallel

    with pytest.raises(ValueError, match="num_query_groups .*=2 is not divisible by tensor parallel size 4"):
        check_tensor_parallel(hf_megatron.ModelConfig.from_hf(tiny_hf_model("llama").config), 4)

"""Pipeline parallelism vs transformers: loss and every parameter gradient of several micro batches.

Each spawned run covers both architectures (llama: untied, gpt2: tied embeddings) and several
layouts; the parent compares with the single-process transformers model (fp32, rel <= 1e-5).
"""
import pytest
import torch
import torch.distributed as dist

import hf_megatron
from dist import run_distributed
from hf_megatron.loading import build_model, build_model_chunks
from hf_megatron.parallel import pipeline, state
from tiny import VOCAB, engine_batches, hf_grads_from_mcore, merge_shards, rel_err, tiny_hf_model

TOL = 1e-5
LAYERS = 4  # interleaving needs pp * vpp = 4 model chunks
LOSS_SCALE = 0.125  # a non-unit scale: gradients are of sum(loss_sum) * scale


def hf_model(arch):
    return tiny_hf_model(arch, **({"n_layer": LAYERS} if arch == "gpt2" else {"num_hidden_layers": LAYERS}))


def micro_batches(n=4, b=2, s=16):
    gen = torch.Generator().manual_seed(7)
    out = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (b, s), generator=gen)
        labels = ids.clone()
        labels[i % b, : 3 + i] = -100  # different token counts per micro batch
        mask = torch.ones_like(ids)
        mask[(i + 1) % b, s - 2 - i:] = 0  # right padding, not a target
        labels[mask == 0] = -100
        out.append({"input_ids": ids, "labels": labels, "attention_mask": mask})
    return out


def hf_reference(arch, mbs):
    """(sum of per-micro-batch loss sums, token count, HF grads, HF model) of one process."""
    model = hf_model(arch)
    loss_sum, tokens = 0.0, 0
    for mb in mbs:
        n = int((mb["labels"][:, 1:] != -100).sum())
        out = model(input_ids=mb["input_ids"], labels=mb["labels"], attention_mask=mb.get("attention_mask"))
        (out.loss * n * LOSS_SCALE).backward()
        loss_sum += out.loss.item() * n
        tokens += n
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return loss_sum, tokens, grads, model


def global_tensors(chunks, kind):
    """{global mcore name: local (TP-sharded) tensor} of p.grad / p.main_grad / p.data over this
    rank's chunks."""
    result = {}
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            tensor = getattr(p, kind, None)
            if tensor is not None:
                result[name] = tensor.clone()  # names carry global layer numbers
    return result


def pipeline_worker(rank, world, tp, pp, cases):
    state.initialize(tp=tp, pp=pp)
    grid = state.get_state()
    results = []
    for arch, vpp, layers, gpt_kwargs in cases:
        torch.manual_seed(0)
        hf = hf_model(arch)
        chunks = build_model_chunks(hf, vpp=vpp, layers_per_stage=layers, **gpt_kwargs)
        mbs = micro_batches()
        evaluated = pipeline.forward_backward(chunks, engine_batches(mbs), forward_only=True)
        assert all(p.grad is None for c in chunks for p in c.parameters())
        out = pipeline.forward_backward(chunks, engine_batches(mbs), loss_scale=LOSS_SCALE)
        pipeline.allreduce_embedding_grads(chunks)
        for chunk in chunks:  # sequence parallel: norm grads come from a sequence shard each
            for p in chunk.parameters():
                if getattr(p, "sequence_parallel", False):
                    dist.all_reduce(p.grad, group=grid.group("tp"))
        results.append({"coords": dict(grid.coords), "out": out, "eval": evaluated,
                        "grad": global_tensors(chunks, "grad"), "weight": global_tensors(chunks, "data")})
    if tp == 1:
        # fresh weights from a ModelConfig: the same as one process's init (compared in the parent)
        config = hf_megatron.ModelConfig.from_hf(hf_model("gpt2").config)
        chunks = build_model_chunks(config, vpp=2, seed=99)
        results.append({"coords": dict(grid.coords), "weight": global_tensors(chunks, "data")})
        # interleaving with a micro-batch count that is not a multiple of pp: clear error
        with pytest.raises(ValueError, match="multiple of the pipeline size"):
            pipeline.forward_backward(chunks, engine_batches(micro_batches(3)))
        # fewer micro batches than stages (torch's 1F1B refuses: GPipe order, as Megatron's 1F1B)
        chunks = build_model_chunks(hf_model("llama"))
        unmasked = [{"input_ids": mb["input_ids"], "labels": mb["labels"]} for mb in micro_batches(1)]
        results.append(pipeline.forward_backward(chunks, engine_batches(unmasked), loss_scale=LOSS_SCALE))
        # bf16 activations travel between stages as bf16
        chunks = build_model_chunks(hf_model("gpt2"), dtype=torch.bfloat16)
        out = pipeline.forward_backward(chunks, engine_batches(micro_batches()), loss_scale=LOSS_SCALE)
        for p in chunks[0].parameters():  # the mixed-precision optimizer's fp32 accumulators
            p.main_grad, p.grad = p.grad.float(), None
        pipeline.allreduce_embedding_grads(chunks)  # reduces main_grad where present
        results.append({"coords": dict(grid.coords), "out": out, "grad": global_tensors(chunks, "main_grad")})
    return results


def full_tensors(per_rank, case, key, config, tp):
    """Merge this case's per-rank tensors into full tensors (TP merge; stages are disjoint)."""
    by_tp = [dict() for _ in range(tp)]
    for rank_results in per_rank:
        item = rank_results[case]
        by_tp[item["coords"]["tp"]].update(item[key])
    return merge_shards(by_tp, config)


def check_case(per_rank, case, arch, tp):
    mbs = micro_batches()
    ref_loss, ref_tokens, ref_grads, hf = hf_reference(arch, mbs)
    config = hf_megatron.ModelConfig.from_hf(hf.config)
    for rank_results in per_rank:  # every pipeline rank reports the same totals
        for key in ("out", "eval"):
            result = rank_results[case][key]
            assert int(result["num_tokens"]) == ref_tokens
            assert abs(result["loss_sum"].item() - ref_loss) <= TOL * ref_loss
    grads = full_tensors(per_rank, case, "grad", config, tp)
    weights = full_tensors(per_rank, case, "weight", config, tp)
    if config.tie_word_embeddings:
        # the last stage's output-layer copy starts equal to the embedding and gets the same grad
        assert torch.equal(weights["output_layer.weight"], hf.transformer.wte.weight.detach())
        assert rel_err(grads.pop("output_layer.weight"), ref_grads["transformer.wte.weight"]) <= TOL
        ref_grads.pop("lm_head.weight", None)
    ours = hf_grads_from_mcore(grads, config)
    assert set(ours) == set(ref_grads)
    for name, grad in ref_grads.items():
        assert rel_err(ours[name], grad) <= TOL, (arch, case, name)


# (arch, vpp, layers per model chunk, GPTModel kwargs)
PP2_CASES = [("llama", 1, None, {}), ("gpt2", 1, None, {}),
             ("llama", 2, None, {}), ("gpt2", 2, None, {"recompute": "full"}),
             ("llama", 1, [1, 3], {"recompute": "selective"}), ("gpt2", 1, [3, 1], {}),
             ("llama", 2, [1, 2, 0, 1], {})]


def test_pp2_1f1b_interleaved_uneven_match_transformers():
    per_rank = run_distributed(pipeline_worker, 2, (1, 2, PP2_CASES))
    for case, (arch, *_rest) in enumerate(PP2_CASES):
        check_case(per_rank, case, arch, tp=1)

    fresh = {}
    for rank_results in per_rank:
        fresh.update(rank_results[len(PP2_CASES)]["weight"])
    config = hf_megatron.ModelConfig.from_hf(hf_model("gpt2").config)
    single = build_model(config, seed=99)
    expected = single.state_dict()
    expected["output_layer.weight"] = expected["embedding.word_embeddings.weight"]  # tied: last stage's copy
    assert set(fresh) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(fresh[name], tensor), name

    unmasked = [{"input_ids": mb["input_ids"], "labels": mb["labels"]} for mb in micro_batches(1)]
    ref_loss, ref_tokens, _, _ = hf_reference("llama", unmasked)
    for rank_results in per_rank:
        one = rank_results[len(PP2_CASES) + 1]
        assert int(one["num_tokens"]) == ref_tokens
        assert abs(one["loss_sum"].item() - ref_loss) <= TOL * ref_loss

    # bf16: the same ops in the same order, up to CPU kernels' thread-count dependent reductions
    # (norm weights) and the tied embedding's two gradients summed after, not during, the micro
    # batches: a few bf16 ulps (2^-8 relative each)
    single = hf_megatron.from_pretrained(hf_model("gpt2"), dtype=torch.bfloat16)
    ref = pipeline.forward_backward([single], engine_batches(micro_batches()), loss_scale=LOSS_SCALE)
    for rank_results in per_rank:
        out = rank_results[len(PP2_CASES) + 2]["out"]
        assert abs(out["loss_sum"].item() - ref["loss_sum"].item()) <= 1e-3 * ref["loss_sum"].item()
    grads = full_tensors(per_rank, len(PP2_CASES) + 2, "grad", single.config, 1)
    assert all(grad.dtype == torch.float32 for grad in grads.values())  # the main_grads
    expected = merge_shards([{n: p.grad for n, p in single.named_parameters()}], single.config)
    expected["output_layer.weight"] = expected["embedding.word_embeddings.weight"]
    assert set(grads) == set(expected)
    for name, grad in expected.items():
        assert rel_err(grads[name], grad) <= 2e-2, name


TP2_PP2_CASES = [("llama", 1, None, {"sequence_parallel": True}), ("gpt2", 1, None, {}),
                 ("gpt2", 2, None, {"sequence_parallel": True})]


def test_tp2_pp2_matches_transformers():
    per_rank = run_distributed(pipeline_worker, 4, (2, 2, TP2_PP2_CASES))
    for case, (arch, *_rest) in enumerate(TP2_PP2_CASES):
        check_case(per_rank, case, arch, tp=2)


def test_pp1_is_a_plain_loop_over_one_full_model():
    hf = hf_model("gpt2")
    chunks = build_model_chunks(hf)
    assert len(chunks) == 1 and chunks[0].pre_process and chunks[0].post_process
    assert len(chunks[0].layer_numbers) == LAYERS
    mbs = micro_batches(2)
    out = pipeline.forward_backward(chunks, engine_batches(mbs), loss_scale=LOSS_SCALE)
    pipeline.allreduce_embedding_grads(chunks)  # no-op without pipeline stages
    ref_loss, ref_tokens, ref_grads, _ = hf_reference("gpt2", mbs)
    assert int(out["num_tokens"]) == ref_tokens
    assert abs(out["loss_sum"].item() - ref_loss) <= TOL * ref_loss
    grads = {n: p.grad for n, p in chunks[0].named_parameters()}
    ref_grads.pop("lm_head.weight", None)
    ours = hf_grads_from_mcore(merge_shards([grads], chunks[0].config), chunks[0].config)
    for name, grad in ref_grads.items():
        assert rel_err(ours[name], grad) <= TOL, name
    with pytest.raises(ValueError, match="virtual pipeline size 2 needs"):
        build_model_chunks(hf, vpp=2)
    with pytest.raises(ValueError, match="'attention_mask' must be given in every micro batch"):
        pipeline.forward_backward(chunks, engine_batches([mbs[0], {"input_ids": mbs[1]["input_ids"], "labels": mbs[1]["labels"]}]))

"""Fused output layer + cross entropy (parallel/linear_loss.py) vs transformers: the same loss and
every gradient (fp32, CPU, relative 1e-5), in one process and at tp=2 with and without sequence
parallelism, with several chunks, a padded vocabulary (300 -> 384 rows) and ignored targets."""
import pytest
import torch

from dist import run_distributed
from tiny import VOCAB, hf_grads_from_mcore, hf_reference, local_grads, merge_shards, rel_err, tiny_hf_model

TOL = 1e-5
CHUNK_BYTES = 4 * 384 * 7  # 7 token rows per chunk at tp=1 (14 at tp=2): 32 tokens -> several chunks


def _batch():
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))
    labels = ids.clone()
    labels[0, 3:9] = -100
    return ids, labels


def _reference(arch):
    out, grads = hf_reference(arch, *_batch())
    return out.loss, grads


def _fused_run(arch, sequence_parallel=False, fns=None, dtype=None):
    import hf_megatron
    from hf_megatron.model.gpt import shift_labels
    from hf_megatron.parallel.linear_loss import FusedLinearLoss, apply_fused_linear_loss
    from hf_megatron.training.trainer import sync_sequence_parallel_grads
    model = hf_megatron.from_pretrained(tiny_hf_model(arch), sequence_parallel=sequence_parallel)
    if dtype is not None:
        model.to(dtype)
    apply_fused_linear_loss(model, chunk_bytes=CHUNK_BYTES)
    assert isinstance(model.vocab_loss, FusedLinearLoss)
    if fns is not None:  # the chunk functions a compiled model runs (linear_loss.COMPILED), here eager
        model.vocab_loss.fns = fns
    ids, labels = _batch()
    out = model(ids, targets=shift_labels(labels), return_logits=False)
    assert out.logits is None
    out.loss.backward()
    sync_sequence_parallel_grads(model.parameters())
    return out.loss.detach(), local_grads(model), model.config


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # llama: tied embeddings; gpt2: learned positions, tied
def test_fused_linear_loss_matches_transformers(arch):
    ref_loss, ref_grads = _reference(arch)
    loss, grads, config = _fused_run(arch)
    assert abs(loss.item() - ref_loss.item()) <= TOL * ref_loss.item()
    ours = hf_grads_from_mcore(merge_shards([grads], config), config)
    assert set(ours) == set(ref_grads)
    for name, grad in ref_grads.items():
        assert rel_err(ours[name], grad) <= TOL, name


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_compiled_chunk_passes_match_transformers(arch):
    """linear_loss.COMPILED (the pure per-chunk functions torch.compile fuses) give transformers'
    loss and gradients too, padded vocabulary and ignored targets included."""
    from hf_megatron.parallel.linear_loss import COMPILED
    ref_loss, ref_grads = _reference(arch)
    loss, grads, config = _fused_run(arch, fns=COMPILED)
    assert abs(loss.item() - ref_loss.item()) <= TOL * ref_loss.item()
    ours = hf_grads_from_mcore(merge_shards([grads], config), config)
    for name, grad in ref_grads.items():
        assert rel_err(ours[name], grad) <= TOL, name


def test_compiled_chunk_passes_equal_eager_ones_in_bf16():
    """In bf16 the two function sets compute the same fp32 values in the same order: bit-equal loss
    and gradients (eager execution of both)."""
    from hf_megatron.parallel.linear_loss import COMPILED, EAGER
    loss_e, grads_e, _ = _fused_run("llama", fns=EAGER, dtype=torch.bfloat16)
    loss_c, grads_c, _ = _fused_run("llama", fns=COMPILED, dtype=torch.bfloat16)
    assert torch.equal(loss_e, loss_c)
    assert grads_e.keys() == grads_c.keys() and all(torch.equal(grads_e[k], grads_c[k]) for k in grads_e)


def test_fused_linear_loss_untied_output_weight():
    ref_loss, ref_grads = _reference("qwen2")
    loss, grads, config = _fused_run("qwen2")
    assert not config.tie_word_embeddings or "lm_head.weight" not in ref_grads
    ours = hf_grads_from_mcore(merge_shards([grads], config), config)
    assert abs(loss.item() - ref_loss.item()) <= TOL * ref_loss.item()
    for name, grad in ref_grads.items():
        assert rel_err(ours[name], grad) <= TOL, name


def _tp_worker(rank, world):
    from hf_megatron.parallel import state
    state.initialize(tp=world)
    return {sp: _fused_run("llama", sp)[:2] for sp in (False, True)}


def test_fused_linear_loss_tensor_parallel_matches_transformers():
    per_rank = run_distributed(_tp_worker, 2)
    ref_loss, ref_grads = _reference("llama")
    from hf_megatron import ModelConfig
    config = ModelConfig.from_hf(tiny_hf_model("llama").config)
    for sp in (False, True):
        for result in per_rank:
            assert abs(result[sp][0].item() - ref_loss.item()) <= TOL * ref_loss.item(), sp
        grads = hf_grads_from_mcore(merge_shards([r[sp][1] for r in per_rank], config), config)
        assert set(grads) == set(ref_grads)
        for name, grad in ref_grads.items():
            assert rel_err(grads[name], grad) <= TOL, (sp, name)


def test_logits_request_takes_the_unfused_path():
    import hf_megatron
    from hf_megatron.parallel.linear_loss import apply_fused_linear_loss
    hf = tiny_hf_model("llama")
    model = apply_fused_linear_loss(hf_megatron.from_pretrained(hf))
    ids, labels = _batch()
    out = model(ids, labels=labels)  # return_logits defaults to True
    assert rel_err(out.logits, hf(input_ids=ids, labels=labels).logits) <= TOL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compiled", [False, True])
def test_fused_linear_loss_bf16_on_gpu_tracks_unfused(compiled):
    """bf16 (8-bit mantissa): the chunked path rounds P and the weight-gradient partial sums per
    chunk, so loss within 1e-2 relative and every gradient within 2e-2 (norm-wise) of the unfused
    bf16 model; odd sizes: 61 tokens per sequence, chunks of 13 rows."""
    from hf_megatron.loading import build_model
    from hf_megatron.model.gpt import shift_labels
    from hf_megatron.parallel.compile import apply_compile
    from hf_megatron.parallel.linear_loss import apply_fused_linear_loss
    ids = torch.randint(0, VOCAB, (3, 61), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    targets = shift_labels(ids)
    results = []
    for fused in (False, True):
        model = build_model(tiny_hf_model("llama"), dtype=torch.bfloat16, device="cuda")
        if fused:
            apply_fused_linear_loss(model, chunk_bytes=4 * 384 * 13)
        if compiled:
            apply_compile(model)
        out = model(ids, targets=targets, return_logits=False)
        out.loss.backward()
        results.append((out.loss.item(), {n: p.grad.float() for n, p in model.named_parameters()}))
    (loss_ref, grads_ref), (loss, grads) = results
    assert abs(loss - loss_ref) <= 1e-2 * loss_ref
    for name, grad in grads_ref.items():
        assert rel_err(grads[name], grad) <= 2e-2, name


def test_fusion_with_final_logit_softcapping_is_refused():
    import hf_megatron
    from hf_megatron.errors import ConfigError
    from hf_megatron.parallel.linear_loss import apply_fused_linear_loss
    model = hf_megatron.from_pretrained(tiny_hf_model("llama"))
    model.config.final_logit_softcapping = 30.0  # as Gemma 2's config sets it
    with pytest.raises(ConfigError, match="final_logit_softcapping"):
        apply_fused_linear_loss(model)

"""GPTModel vs transformers: same weights -> same logits, loss and parameter gradients (fp32, CPU)."""
import pytest
import torch

import hf_megatron
from tiny import VOCAB, hf_grads_from_mcore, local_grads, merge_shards, rel_err, tiny_hf_model

ARCHS = ["gpt2", "llama", "mistral", "qwen2"]
TOL = 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_loss_grads_match_transformers(arch):
    hf = tiny_hf_model(arch)
    ours = hf_megatron.from_pretrained(hf)
    hf.train(), ours.train()  # dropout is 0 in the tiny configs; train mode exercises that path
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :5] = -100  # ignore_index is honoured

    ref = hf(input_ids=ids, labels=labels)
    ref.loss.backward()
    out = ours(ids, labels=labels)
    out.loss.backward()

    assert out.logits.shape == ref.logits.shape == (2, 24, VOCAB)
    assert rel_err(out.logits, ref.logits) <= TOL
    assert abs(out.loss.item() - ref.loss.item()) <= TOL * abs(ref.loss.item())

    ours_hf_grads = hf_grads_from_mcore(merge_shards([local_grads(ours)], ours.config), ours.config)
    hf_grads = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    if hf.config.tie_word_embeddings:
        hf_grads.pop("lm_head.weight", None)
    assert set(ours_hf_grads) == set(hf_grads)
    for name, grad in hf_grads.items():
        assert rel_err(ours_hf_grads[name], grad) <= TOL, name


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_padding_mask_matches_transformers(arch):
    hf = tiny_hf_model(arch).eval()
    ours = hf_megatron.from_pretrained(hf).eval()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # right padding on the second row
    ref = hf(input_ids=ids, attention_mask=mask).logits
    out = ours(ids, attention_mask=mask).logits
    assert rel_err(out[mask.bool()], ref[mask.bool()]) <= TOL


def test_vocab_is_padded_but_logits_are_not():
    hf = tiny_hf_model("llama")
    ours = hf_megatron.from_pretrained(hf)
    assert ours.embedding.word_embeddings.weight.shape[0] == 384  # 300 -> multiple of 128
    assert ours.output_layer.weight.shape[0] == 384
    assert ours(torch.zeros(1, 4, dtype=torch.long)).logits.shape[-1] == VOCAB


def test_state_dict_uses_megatron_core_names():
    ours = hf_megatron.from_pretrained(tiny_hf_model("qwen2"))
    names = set(ours.state_dict())
    for expected in ["embedding.word_embeddings.weight",
                     "decoder.layers.0.input_layernorm.weight",
                     "decoder.layers.0.self_attention.linear_qkv.weight",
                     "decoder.layers.0.self_attention.linear_qkv.bias",
                     "decoder.layers.1.self_attention.linear_proj.weight",
                     "decoder.layers.1.pre_mlp_layernorm.weight",
                     "decoder.layers.1.mlp.linear_fc1.weight",
                     "decoder.layers.1.mlp.linear_fc2.weight",
                     "decoder.final_layernorm.weight",
                     "output_layer.weight"]:
        assert expected in names
    # fused QKV rows: ng * (nh/ng + 2) * hn = 2 * (2 + 2) * 16
    assert ours.state_dict()["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (128, 64)
    # SwiGLU fc1 = [gate; up]
    assert ours.state_dict()["decoder.layers.0.mlp.linear_fc1.weight"].shape == (256, 64)

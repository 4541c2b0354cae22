"""Tiny transformers configs and helpers shared by the tests (2 layers, hidden 64)."""
from __future__ import annotations

import torch
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, GPT2Config, LlamaConfig, MistralConfig,
                          Olmo2Config, Phi3Config, Qwen2Config, Qwen3Config)

from hf_megatron.architectures import mcore_to_hf
from hf_megatron.parallel.sharding import merge_tensor

VOCAB = 300  # not a multiple of 128: exercises vocab padding


def tiny_config(arch: str, **overrides):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64)
    if arch == "gpt2":
        kw = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        kw.update(overrides)
        return GPT2Config(**kw)
    if arch == "llama":  # GQA + llama3 rope scaling
        common.update(num_key_value_heads=2, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}, rope_theta=500000.0)
        common.update(overrides)
        return LlamaConfig(**common)
    if arch == "mistral":  # sliding window shorter than the test sequence
        common.update(num_key_value_heads=2, sliding_window=8)
        common.update(overrides)
        return MistralConfig(**common)
    if arch == "qwen2":  # qkv bias, untied
        common.update(num_key_value_heads=2, tie_word_embeddings=False)
        common.update(overrides)
        return Qwen2Config(**common)
    if arch == "qwen3":  # q/k norms; head_dim 32 != hidden / heads (16); untied
        common.update(num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)
        common.update(overrides)
        return Qwen3Config(**common)
    if arch in FAMILY_CONFIGS:  # the newer families (tests/test_families*.py)
        config_class, family = FAMILY_CONFIGS[arch]
        # no pad id: transformers' embedding would zero that row's gradient (padding_idx)
        common.update(num_key_value_heads=2, pad_token_id=None, bos_token_id=1, eos_token_id=2, **family)
        common.update(overrides)
        return config_class(**common)
    raise ValueError(arch)


# (config class, fields over the common tiny ones); every norm weight is randomised (see below)
FAMILY_CONFIGS = {
    "olmo2": (Olmo2Config, dict(tie_word_embeddings=False)),
    # longrope on half of each head (rotary dims 8): sequences of 16 > 8 use the long factors
    "phi3": (Phi3Config, dict(tie_word_embeddings=False, original_max_position_embeddings=8, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5, short_factor=[1.0, 1.5, 2.0, 3.0],
        long_factor=[1.5, 2.5, 4.0, 8.0]))),
    # head_dim 32 != hidden / heads; query_pre_attn_scalar != head_dim; window 4 on layers 0, 2, ..;
    # soft caps small enough to bend these tiny logits and scores
    "gemma2": (Gemma2Config, dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=4,
                                  attn_logit_softcapping=0.5, final_logit_softcapping=0.2)),
    "gemma3_text": (Gemma3TextConfig, dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=4,
                                           sliding_window_pattern=2, rope_parameters={
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                               "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                  "rope_theta": 50000.0}})),
}
EAGER = ("gemma2", "gemma3_text")  # transformers' sdpa path refuses soft-capping


def tiny_hf_model(arch: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides),
                                             attn_implementation="eager" if arch in EAGER else "sdpa")
    model = model.float()
    # HF zero-inits biases and sets the per-head q/k norms (Qwen3) to one; randomise them so
    # mapping errors would show
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
            elif arch in FAMILY_CONFIGS and "norm" in name:  # post-norms, (1 + w) norms: not their init
                p.uniform_(0.5, 1.5) if not arch.startswith("gemma") else p.uniform_(-0.5, 0.5)
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def hf_grads_from_mcore(full_grads: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Full megatron-core gradients -> HF names (same mapping as the weights)."""
    return dict(mcore_to_hf(lambda n: full_grads[n], config))


def local_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def merge_shards(per_rank: list[dict[str, torch.Tensor]], config) -> dict[str, torch.Tensor]:
    """TP-rank dicts of local tensors -> full tensors (vocab padding removed)."""
    return {name: merge_tensor(name, [d[name] for d in per_rank], config) for name in per_rank[0]}


def engine_batch(mb: dict) -> dict:
    """A transformers-style micro batch (labels, shifted by the model) as the training engine
    takes it: aligned targets (token t scored against targets[t])."""
    from hf_megatron.model.gpt import shift_labels
    out = {k: v for k, v in mb.items() if k != "labels"}
    out["targets"] = shift_labels(mb["labels"])
    return out


def engine_batches(mbs: list[dict]) -> list[dict]:
    return [engine_batch(mb) for mb in mbs]


def hf_reference(arch: str, ids: torch.Tensor, labels: torch.Tensor, **overrides):
    """transformers' output and parameter grads for one batch (tied lm_head grad dropped: it is the
    embedding's)."""
    hf = tiny_hf_model(arch, **overrides)
    out = hf(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    if hf.config.tie_word_embeddings:
        grads.pop("lm_head.weight", None)
    return out, grads

"""Per-architecture weight mappings: transformers names <-> megatron-core GPTModel names.

Both directions work on *full* (unsharded) tensors and are lazy: they take `get(name) ->
Tensor` and yield `(name, tensor)` one at a time, so converters can stream a large model
tensor by tensor.  Tensor-parallel sharding is a separate step (`layout.py`).

Fused QKV (megatron-core): rows ordered per query group g as [q heads of g; k_g; v_g]:
    W_qkv = cat_g( cat(Wq[g*hpg*hn:(g+1)*hpg*hn], Wk[g*hn:(g+1)*hn], Wv[g*hn:(g+1)*hn]) )
SwiGLU: linear_fc1 = [gate; up] (full); GPT-2's Conv1D weights are [in, out] (transposed).
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from ..config import ModelConfig

Getter = Callable[[str], torch.Tensor]
Pair = tuple[str, torch.Tensor]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    ng, hn = config.num_query_groups, config.kv_channels
    tail = q.shape[1:]  # (hidden,) for weights, () for biases
    q = q.reshape(ng, -1, *tail)
    k, v = k.reshape(ng, hn, *tail), v.reshape(ng, hn, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def split_qkv(qkv: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ng, hn = config.num_query_groups, config.kv_channels
    q_rows = config.num_attention_heads // ng * hn
    tail = qkv.shape[1:]
    grouped = qkv.reshape(ng, q_rows + 2 * hn, *tail)
    q = grouped[:, :q_rows].reshape(-1, *tail)
    k = grouped[:, q_rows:q_rows + hn].reshape(-1, *tail)
    v = grouped[:, q_rows + hn:].reshape(-1, *tail)
    return q.contiguous(), k.contiguous(), v.contiguous()


# ------------------------------------------------------------------------- Llama family
# (llama, mistral, qwen2 share names; biases exist where the config says so)

def _llama_to_mcore(get: Getter, config: ModelConfig, layers) -> Iterator[Pair]:
    yield "embedding.word_embeddings.weight", get("model.embed_tokens.weight")
    attn_bias = config.add_qkv_bias
    for i in layers:
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
        yield mc + "input_layernorm.weight", get(hf + "input_layernorm.weight")
        qkv = [get(hf + f"self_attn.{p}_proj.weight") for p in "qkv"]
        yield mc + "self_attention.linear_qkv.weight", fuse_qkv(*qkv, config)
        if attn_bias:
            qkv = [get(hf + f"self_attn.{p}_proj.bias") for p in "qkv"]
            yield mc + "self_attention.linear_qkv.bias", fuse_qkv(*qkv, config)
        yield mc + "self_attention.linear_proj.weight", get(hf + "self_attn.o_proj.weight")
        if config.add_proj_bias:
            yield mc + "self_attention.linear_proj.bias", get(hf + "self_attn.o_proj.bias")
        yield mc + "pre_mlp_layernorm.weight", get(hf + "post_attention_layernorm.weight")
        yield mc + "mlp.linear_fc1.weight", torch.cat([get(hf + "mlp.gate_proj.weight"), get(hf + "mlp.up_proj.weight")])
        if config.add_mlp_bias:
            yield mc + "mlp.linear_fc1.bias", torch.cat([get(hf + "mlp.gate_proj.bias"), get(hf + "mlp.up_proj.bias")])
        yield mc + "mlp.linear_fc2.weight", get(hf + "mlp.down_proj.weight")
        if config.add_mlp_bias:
            yield mc + "mlp.linear_fc2.bias", get(hf + "mlp.down_proj.bias")
    yield "decoder.final_layernorm.weight", get("model.norm.weight")
    if not config.tie_word_embeddings:
        yield "output_layer.weight", get("lm_head.weight")


def _llama_from_mcore(get: Getter, config: ModelConfig, layers) -> Iterator[Pair]:
    yield "model.embed_tokens.weight", get("embedding.word_embeddings.weight")
    for i in layers:
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
        yield hf + "input_layernorm.weight", get(mc + "input_layernorm.weight")
        for name, tensor in zip("qkv", split_qkv(get(mc + "self_attention.linear_qkv.weight"), config)):
            yield hf + f"self_attn.{name}_proj.weight", tensor
        if config.add_qkv_bias:
            for name, tensor in zip("qkv", split_qkv(get(mc + "self_attention.linear_qkv.bias"), config)):
                yield hf + f"self_attn.{name}_proj.bias", tensor
        yield hf + "self_attn.o_proj.weight", get(mc + "self_attention.linear_proj.weight")
        if config.add_proj_bias:
            yield hf + "self_attn.o_proj.bias", get(mc + "self_attention.linear_proj.bias")
        yield hf + "post_attention_layernorm.weight", get(mc + "pre_mlp_layernorm.weight")
        gate, up = get(mc + "mlp.linear_fc1.weight").chunk(2, dim=0)
        yield hf + "mlp.gate_proj.weight", gate.contiguous()
        yield hf + "mlp.up_proj.weight", up.contiguous()
        if config.add_mlp_bias:
            gate, up = get(mc + "mlp.linear_fc1.bias").chunk(2, dim=0)
            yield hf + "mlp.gate_proj.bias", gate.contiguous()
            yield hf + "mlp.up_proj.bias", up.contiguous()
        yield hf + "mlp.down_proj.weight", get(mc + "mlp.linear_fc2.weight")
        if config.add_mlp_bias:
            yield hf + "mlp.down_proj.bias", get(mc + "mlp.linear_fc2.bias")
    yield "model.norm.weight", get("decoder.final_layernorm.weight")
    if not config.tie_word_embeddings:
        yield "lm_head.weight", get("output_layer.weight")


# ------------------------------------------------------------------------- GPT-2

_GPT2_NORMS = (("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm"))


def _gpt2_to_mcore(get: Getter, config: ModelConfig, layers) -> Iterator[Pair]:
    yield "embedding.word_embeddings.weight", get("transformer.wte.weight")
    yield "embedding.position_embeddings.weight", get("transformer.wpe.weight")
    h = config.hidden_size
    for i in layers:
        hf, mc = f"transformer.h.{i}.", f"decoder.layers.{i}."
        for hf_norm, mc_norm in _GPT2_NORMS:
            for p in ("weight", "bias"):
                yield mc + f"{mc_norm}.{p}", get(hf + f"{hf_norm}.{p}")
        w = get(hf + "attn.c_attn.weight").t()  # Conv1D [in, out] -> [out, in] = [q; k; v]
        yield mc + "self_attention.linear_qkv.weight", fuse_qkv(w[:h], w[h:2 * h], w[2 * h:], config)
        b = get(hf + "attn.c_attn.bias")
        yield mc + "self_attention.linear_qkv.bias", fuse_qkv(b[:h], b[h:2 * h], b[2 * h:], config)
        yield mc + "self_attention.linear_proj.weight", get(hf + "attn.c_proj.weight").t().contiguous()
        yield mc + "self_attention.linear_proj.bias", get(hf + "attn.c_proj.bias")
        yield mc + "mlp.linear_fc1.weight", get(hf + "mlp.c_fc.weight").t().contiguous()
        yield mc + "mlp.linear_fc1.bias", get(hf + "mlp.c_fc.bias")
        yield mc + "mlp.linear_fc2.weight", get(hf + "mlp.c_proj.weight").t().contiguous()
        yield mc + "mlp.linear_fc2.bias", get(hf + "mlp.c_proj.bias")
    yield "decoder.final_layernorm.weight", get("transformer.ln_f.weight")
    yield "decoder.final_layernorm.bias", get("transformer.ln_f.bias")


def _gpt2_from_mcore(get: Getter, config: ModelConfig, layers) -> Iterator[Pair]:
    yield "transformer.wte.weight", get("embedding.word_embeddings.weight")
    yield "transformer.wpe.weight", get("embedding.position_embeddings.weight")
    for i in layers:
        hf, mc = f"transformer.h.{i}.", f"decoder.layers.{i}."
        for hf_norm, mc_norm in _GPT2_NORMS:
            for p in ("weight", "bias"):
                yield hf + f"{hf_norm}.{p}", get(mc + f"{mc_norm}.{p}")
        q, k, v = split_qkv(get(mc + "self_attention.linear_qkv.weight"), config)
        yield hf + "attn.c_attn.weight", torch.cat([q, k, v]).t().contiguous()
        yield hf + "attn.c_attn.bias", torch.cat(split_qkv(get(mc + "self_attention.linear_qkv.bias"), config))
        yield hf + "attn.c_proj.weight", get(mc + "self_attention.linear_proj.weight").t().contiguous()
        yield hf + "attn.c_proj.bias", get(mc + "self_attention.linear_proj.bias")
        yield hf + "mlp.c_fc.weight", get(mc + "mlp.linear_fc1.weight").t().contiguous()
        yield hf + "mlp.c_fc.bias", get(mc + "mlp.linear_fc1.bias")
        yield hf + "mlp.c_proj.weight", get(mc + "mlp.linear_fc2.weight").t().contiguous()
        yield hf + "mlp.c_proj.bias", get(mc + "mlp.linear_fc2.bias")
    yield "transformer.ln_f.weight", get("decoder.final_layernorm.weight")
    yield "transformer.ln_f.bias", get("decoder.final_layernorm.bias")


TO_MCORE = {"llama": _llama_to_mcore, "mistral": _llama_to_mcore, "qwen2": _llama_to_mcore, "gpt2": _gpt2_to_mcore}
FROM_MCORE = {"llama": _llama_from_mcore, "mistral": _llama_from_mcore, "qwen2": _llama_from_mcore,
              "gpt2": _gpt2_from_mcore}


def _lookup(table: dict, config: ModelConfig):
    try:
        return table[config.model_type]
    except KeyError:
        raise ValueError(f"no weight mapping for model_type {config.model_type!r}; "
                         f"supported: {', '.join(sorted(table))}") from None


def hf_to_mcore(get: Getter, config: ModelConfig, layers=None) -> Iterator[Pair]:
    """Yield full megatron-core tensors from HF tensors (`get(hf_name)`); `layers`: the global
    layer numbers to convert (default all) -- embeddings, final norm and output always come."""
    return _lookup(TO_MCORE, config)(get, config, range(config.num_layers) if layers is None else layers)


def mcore_to_hf(get: Getter, config: ModelConfig, layers=None) -> Iterator[Pair]:
    """Yield HF tensors from full megatron-core tensors (`get(mcore_name)`); vocab unpadded by caller."""
    return _lookup(FROM_MCORE, config)(get, config, range(config.num_layers) if layers is None else layers)

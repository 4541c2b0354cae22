"""Megatron-LM's legacy (pre-mcore) parameter names and QKV orderings -> megatron-core.

Legacy GPT state dicts are nested (`model['language_model']['encoder']['layers.0....']`);
flattened with dots they read `language_model.encoder.layers.N.self_attention.query_key_value...`
(older still: `language_model.transformer.` and `attention.`).

The fused QKV rows of one tensor-parallel shard (np local heads, hn head dim) are ordered by
`checkpoint_version`:
    0      (3, np, hn)   all q heads, then all k, then all v
    1.0    (np, hn, 3)   q, k, v interleaved inside each head
    >= 2.0 (np, 3, hn)   per head [q; k; v]  -- megatron-core's layout (ng = np for MHA)
Versions 0 and 1 are permuted to the >= 2.0 order, shard by shard, before TP shards merge.
"""
from __future__ import annotations

import re

import torch

_RENAMES = [  # (legacy pattern, mcore replacement), applied in order
    (r"^language_model\.embedding\.word_embeddings\.", "embedding.word_embeddings."),
    (r"^language_model\.embedding\.position_embeddings\.", "embedding.position_embeddings."),
    (r"^language_model\.(encoder|transformer)\.final_(layernorm|norm)\.", "decoder.final_layernorm."),
    (r"^language_model\.(encoder|transformer)\.layers\.", "decoder.layers."),
    (r"^language_model\.output_layer\.", "output_layer."),
    (r"^word_embeddings_for_head\.", "output_layer."),
    (r"\.(self_attention|attention)\.query_key_value\.", ".self_attention.linear_qkv."),
    (r"\.(self_attention|attention)\.dense\.", ".self_attention.linear_proj."),
    (r"\.post_attention_(layernorm|norm)\.", ".pre_mlp_layernorm."),
    (r"\.input_norm\.", ".input_layernorm."),
    (r"\.mlp\.dense_h_to_4h\.", ".mlp.linear_fc1."),
    (r"\.mlp\.dense_4h_to_h\.", ".mlp.linear_fc2."),
]


# TransformerEngine fuses the pre-attention / pre-MLP norms into linear_qkv / linear_fc1; its
# names (also what torch_dist checkpoints always use) -> the separate-norm names we use
_TE_NORMS = [
    (".self_attention.linear_qkv.layer_norm_weight", ".input_layernorm.weight"),
    (".self_attention.linear_qkv.layer_norm_bias", ".input_layernorm.bias"),
    (".mlp.linear_fc1.layer_norm_weight", ".pre_mlp_layernorm.weight"),
    (".mlp.linear_fc1.layer_norm_bias", ".pre_mlp_layernorm.bias"),
]


def local_to_te_name(name: str) -> str:
    """The separate-norm name -> TransformerEngine's fused-norm name (torch_dist's sharded keys)."""
    for te, local in _TE_NORMS:
        if name.endswith(local):
            return name[: -len(local)] + te
    return name


def te_to_local_name(name: str) -> str:
    for te, local in _TE_NORMS:
        if name.endswith(te):
            return name[: -len(te)] + local
    return name


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    """Nested dicts -> one dict with dotted keys (tensors and other leaves kept)."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def is_legacy(names) -> bool:
    return any(n.startswith(("language_model.", "word_embeddings_for_head.")) for n in names)


def legacy_to_mcore_name(name: str) -> str:
    for pattern, replacement in _RENAMES:
        name = re.sub(pattern, replacement, name)
    return name


def fix_qkv_ordering(tensor: torch.Tensor, checkpoint_version: float, local_heads: int) -> torch.Tensor:
    """One TP shard of a fused QKV weight/bias in `checkpoint_version` order -> (np, 3, hn) rows."""
    if checkpoint_version >= 2.0:
        return tensor
    tail = tuple(tensor.shape[1:])
    hn = tensor.shape[0] // (3 * local_heads)
    if checkpoint_version == 0:
        grouped = tensor.reshape(3, local_heads, hn, *tail).transpose(0, 1)
    else:  # 1.0
        grouped = tensor.reshape(local_heads, hn, 3, *tail).transpose(1, 2)
    return grouped.reshape(tensor.shape).contiguous()


def model_state_to_mcore(model_state: dict, checkpoint_version: float, local_heads: int) -> dict[str, torch.Tensor]:
    """One rank's `model` entry (mcore, TransformerEngine or legacy names; nested or flat) ->
    flat mcore names, tensors only.  TransformerEngine's `_extra_state` entries are dropped."""
    flat = {k: v for k, v in flatten(model_state).items()
            if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    if not is_legacy(flat):
        return {te_to_local_name(k): v for k, v in flat.items()}
    out = {}
    for name, tensor in flat.items():
        new = legacy_to_mcore_name(name)
        if ".linear_qkv." in new:
            tensor = fix_qkv_ordering(tensor, checkpoint_version, local_heads)
        out[new] = tensor
    return out


# megatron-core name -> the legacy name older readers take (transformers' GPT-2 script,
# Megatron-DeepSpeed): `*layernorm` norms, as before Megatron-LM renamed them `*_norm`
_TO_LEGACY = [
    (r"^embedding\.", "language_model.embedding."),
    (r"^decoder\.final_layernorm\.", "language_model.encoder.final_layernorm."),
    (r"^decoder\.layers\.", "language_model.encoder.layers."),
    (r"^output_layer\.", "language_model.output_layer."),
    (r"\.self_attention\.linear_qkv\.", ".self_attention.query_key_value."),
    (r"\.self_attention\.linear_proj\.", ".self_attention.dense."),
    (r"\.pre_mlp_layernorm\.", ".post_attention_layernorm."),
    (r"\.mlp\.linear_fc1\.", ".mlp.dense_h_to_4h."),
    (r"\.mlp\.linear_fc2\.", ".mlp.dense_4h_to_h."),
]
# submodules the legacy model keeps as nested state dicts (the rest of a part is one flat dict)
_NESTED = ("language_model.embedding.word_embeddings.", "language_model.embedding.position_embeddings.",
           "language_model.output_layer.")


def mcore_to_legacy_name(name: str) -> str:
    if ".q_layernorm." in name or ".k_layernorm." in name:
        raise ValueError(f"{name}: legacy Megatron models have no q/k layernorm")
    for pattern, replacement in _TO_LEGACY:
        name = re.sub(pattern, replacement, name)
    return name


def mcore_to_legacy(state: dict[str, torch.Tensor]) -> dict:
    """One chunk's mcore state dict -> the nested legacy `model` entry:

        {"language_model": {"embedding": {"word_embeddings": {"weight"}, "position_embeddings": {...}},
                            "encoder": {"layers.0.input_layernorm.weight": ..., ..., "final_layernorm.weight"},
                            "output_layer": {"weight"}}}

    Layers come before the final norm (the GPT-2 script stops at the first non-layer key).  The
    QKV rows stay in the (np, 3, hn) order of checkpoint_version >= 2."""
    ordered = sorted(state.items(), key=lambda item: ".final_layernorm." in item[0])
    model: dict = {}
    for name, tensor in ordered:
        legacy = mcore_to_legacy_name(name)
        nested = next((prefix for prefix in _NESTED if legacy.startswith(prefix)), None)
        if nested:
            parts = nested.rstrip(".").split(".") + [legacy[len(nested):]]
        else:  # language_model.<part>.<flat key>
            parts = legacy.split(".", 2)
        node = model
        for key in parts[:-1]:
            node = node.setdefault(key, {})
        node[parts[-1]] = tensor
    return model

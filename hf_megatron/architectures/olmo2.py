"""OLMo 2: Llama's attention and MLP with post-norms only, and q/k RMSNorm over the whole projection.

    x += post_attn_norm(attn(x));   x += post_mlp_norm(mlp(x))        (no pre-norms)
    q = RMSNorm_q(W_q x) over all nh * hn values,  k = RMSNorm_k(W_k x) over all ng * hn, before RoPE

The q/k norm weights ([nh * hn], [ng * hn]) are split with the heads under tensor parallelism
(column style), and the norm's sum of squares is all-reduced over the TP ranks
(`parallel.projection_norm`), so any tp that divides the query groups is exact.
megatron-core's GPTModel has neither post-norms nor whole-projection q/k norms: Megatron-LM's
flags do not describe OLMo 2 (our checkpoints carry the HF config in `args.hf_config`).
"""
from __future__ import annotations

from typing import Any

from .base import Architecture, Row, edit_rows
from .llama import WEIGHTS as LLAMA_WEIGHTS
from .llama import H, L, llama_like_fields
from .plan import LAYER, Shard, gpt_plan

WEIGHTS = edit_rows(LLAMA_WEIGHTS, drop=(L + "input_layernorm.weight", L + "pre_mlp_layernorm.weight"), after={
    L + "self_attention.linear_qkv.bias": (
        Row(L + "self_attention.q_layernorm.weight", H + "self_attn.q_norm.weight"),
        Row(L + "self_attention.k_layernorm.weight", H + "self_attn.k_norm.weight")),
    L + "self_attention.linear_proj.bias": (
        Row(L + "post_self_attn_layernorm.weight", H + "post_attention_layernorm.weight"),),
    L + "mlp.linear_fc2.bias": (Row(L + "post_mlp_layernorm.weight", H + "post_feedforward_layernorm.weight"),),
})


def _fields(data: dict[str, Any]) -> dict[str, Any]:
    return {**llama_like_fields(data), "qk_layernorm": True, "qk_layernorm_scope": "projection",
            "pre_layernorm": False, "post_layernorm": True}


def _plan(config) -> dict[str, Shard]:
    """Megatron's GPT plan, plus the whole-projection q/k norms split with the heads."""
    return {**gpt_plan(config), LAYER + "self_attention.q_layernorm": Shard("column"),
            LAYER + "self_attention.k_layernorm": Shard("column")}


OLMO2 = Architecture("olmo2", ("Olmo2ForCausalLM",), _fields, WEIGHTS, plan=_plan)

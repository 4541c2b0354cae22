"""Parallel plans: which weight of the megatron-core GPTModel is split how.

One table per architecture family drives both the tensor-parallel modules
(`hf_megatron.parallel.parallelize`) and the checkpoint split/merge
(`hf_megatron.parallel.sharding`), so layer shapes and the on-disk layout cannot drift.

A plan maps a *module* path pattern (`*` stands for one path component, e.g. a layer number)
to a `Shard` style:

    column      Y = X A^T, A split by output rows (weight and bias on dim 0).  `parts` > 1 for a
                fused output made of equal parts that are split separately, each rank holding
                [part_1,r; part_2,r; ...] (SwiGLU fc1: [gate_r; up_r]).  The fused QKV needs no
                parts: megatron-core orders its rows per query group, so a rank's groups are one
                contiguous block.
    row         Y = X A^T, A split by input columns (weight on dim 1); the bias is replicated
                and added once after the reduction.
    vocab       an embedding or output table: rows zero-padded to a multiple of
                `make_vocab_size_divisible_by * tp`, then split on dim 0.
Modules not in the plan (norms, position embeddings, per-head norms) are replicated.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    style: str  # "column" | "row" | "vocab"
    parts: int = 1

    def __post_init__(self) -> None:
        if self.style not in ("column", "row", "vocab"):
            raise ValueError(f"Shard style must be 'column', 'row' or 'vocab', got {self.style!r}")


REPLICATED = None
LAYER = "decoder.layers.*."


def gpt_plan(config) -> dict[str, Shard]:
    """The plan of megatron-core's GPTModel (GPT-2, Llama, Mistral, Qwen2 share it)."""
    return {
        "embedding.word_embeddings": Shard("vocab"),
        LAYER + "self_attention.linear_qkv": Shard("column"),
        LAYER + "self_attention.linear_proj": Shard("row"),
        LAYER + "mlp.linear_fc1": Shard("column", parts=2 if config.gated_mlp else 1),
        LAYER + "mlp.linear_fc2": Shard("row"),
        "output_layer": Shard("vocab"),
    }


def module_rule(plan: dict[str, Shard], module_name: str) -> Shard | None:
    """The plan entry for a module path (None: replicated)."""
    rule = plan.get(module_name)
    if rule is not None:
        return rule
    parts = module_name.split(".")
    for pattern, rule in plan.items():
        pattern_parts = pattern.split(".")
        if len(pattern_parts) == len(parts) and all(fnmatch.fnmatchcase(p, q) for p, q in zip(parts, pattern_parts)):
            return rule
    return None


def param_rule(plan: dict[str, Shard], param_name: str) -> tuple[str, int | None, int]:
    """(style, dim, parts) for a parameter name: style 'replicated' has dim None."""
    module_name, _, leaf = param_name.rpartition(".")
    rule = module_rule(plan, module_name)
    if rule is None:
        return "replicated", None, 1
    if rule.style == "row":
        return ("row", 1, 1) if leaf == "weight" else ("replicated", None, 1)
    return rule.style, 0, rule.parts

"""The user's optimizer parameter groups, carried over to the Megatron model chunks.

A torch optimizer built over the transformers model holds groups of *its* parameters
(`{"params": [...], "weight_decay": 0.0}`, ...).  Each chunk parameter is made of one or more
transformers parameters (the architecture's mapping table: q/k/v -> linear_qkv, gate/up ->
linear_fc1, ...); it joins the group they belong to.  An optimizer built over the *prepared* model
(`model = accelerator.prepare(model); AdamW(model.parameters())`) holds the chunk parameters
themselves; each joins its own group.  Per-group options kept: weight_decay,
betas, eps, and lr as a multiplier of the optimizer's base lr (`lr_mult`, which the LR
schedules scale; `user_group` says which user group it came from).  A chunk parameter whose sources sit in different groups, or in none, is
refused in one line.
"""
from __future__ import annotations

import weakref

import torch

from ...architectures import get as architecture
from ...architectures.base import expand
from ...errors import ConfigError

KEPT_OPTIONS = ("weight_decay", "betas", "eps")


def hf_param_refs(hf_model: torch.nn.Module) -> dict[str, "weakref.ref"]:
    """name -> weak reference of every transformers parameter (tied names included)."""
    return {name: weakref.ref(p) for name, p in hf_model.named_parameters(remove_duplicate=False)}


def _sources(config) -> dict[str, tuple[str, ...]]:
    """megatron-core name (global layer numbers) -> the transformers names it is made of."""
    sources = {mcore: hf for mcore, hf, _ in expand(architecture(config.model_type).weights, config)}
    if config.tie_word_embeddings:  # the last stage's copy of the tied table
        sources["output_layer.weight"] = sources["embedding.word_embeddings.weight"]
    return sources


def _option(group: dict, defaults: dict, name: str):
    return group.get(name, defaults.get(name))


def chunk_param_groups(optimizer: torch.optim.Optimizer, hf_refs: dict[str, "weakref.ref"], chunks) -> list[dict]:
    base_lr = optimizer.defaults.get("lr") or optimizer.param_groups[0]["lr"]
    group_of = {id(p): index for index, g in enumerate(optimizer.param_groups) for p in g["params"]}
    hf_group = {}
    for name, ref in hf_refs.items():
        param = ref()
        if param is not None and id(param) in group_of:
            hf_group[name] = group_of[id(param)]
    sources = _sources(chunks[0].config)
    members: dict[int, list[torch.nn.Parameter]] = {}
    seen = set()
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            if id(param) in group_of:  # an optimizer over the prepared model's own parameters
                members.setdefault(group_of[id(param)], []).append(param)
                continue
            groups = {hf_group.get(source) for source in sources[name]}
            if None in groups:
                missing = name if not hf_group else ", ".join(sources[name])  # prepared-model names / transformers'
                raise ConfigError(f"accelerator.prepare(optimizer): {missing} not in the optimizer's "
                                  f"parameter groups; give the optimizer every model parameter")
            if len(groups) > 1:
                raise ConfigError(f"accelerator.prepare(optimizer): {', '.join(sources[name])} are fused into one "
                                  f"Megatron parameter ({name}) but sit in different parameter groups {sorted(groups)}; "
                                  f"put them in one group")
            members.setdefault(groups.pop(), []).append(param)
    out = []
    for index in sorted(members):
        group = optimizer.param_groups[index]
        options = {name: _option(group, optimizer.defaults, name) for name in KEPT_OPTIONS}
        lr = group.get("lr", base_lr)
        out.append({"params": members[index], **{k: v for k, v in options.items() if v is not None},
                    "lr": lr, "lr_mult": lr / base_lr if base_lr else 1.0, "user_group": index})
    return out

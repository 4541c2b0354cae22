"""The `Architecture` record, and the weight-mapping machinery every family shares.

A family's weight mapping is ONE table.  Each row names one megatron-core tensor, the HF
tensor(s) it is made of, and the transform between them:

    Row("decoder.layers.{i}.self_attention.linear_qkv.weight",
        ("model.layers.{i}.self_attn.q_proj.weight", "...k_proj.weight", "...v_proj.weight"), FUSE_QKV)

`{i}` is the global layer number; a row with `when="add_qkv_bias"` (or `"not tie_word_embeddings"`)
exists only when that ModelConfig flag says so.  Both directions, `hf_to_mcore` and
`mcore_to_hf`, are derived from the table: a transform carries its own inverse, so there is no
hand-written mirror to drift.  Both are lazy -- they call `get(name)` and yield `(name, tensor)`
one row at a time, on *full* (unsharded) tensors -- and only reshape, slice, concatenate and
transpose, so they are bit-exact and also run on meta tensors (shape planning).

Fused QKV (megatron-core): rows ordered per query group g as [q heads of g; k_g; v_g]:
    W_qkv = cat_g( cat(Wq[g*hpg*hn:(g+1)*hpg*hn], Wk[g*hn:(g+1)*hn], Wv[g*hn:(g+1)*hn]) )
with hpg = heads per group, hn = head dim.  SwiGLU fc1 = [gate; up] (full tensors; the per-rank
[gate_r; up_r] is the parallel plan's business).  GPT-2's Conv1D weights are [in, out].
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from ..config import ConfigError, ModelConfig, null_tokenizer_eod
from .plan import Shard, gpt_plan

Getter = Callable[[str], torch.Tensor]
Pair = tuple[str, torch.Tensor]
Tensors = tuple[torch.Tensor, ...]


# ------------------------------------------------------------------------------ transforms


@dataclass(frozen=True)
class Transform:
    """HF tensors of one row -> its megatron-core tensor(s) (`to_mcore`), and back (`to_hf`)."""

    name: str
    to_mcore: Callable[[Tensors, ModelConfig], Tensors]
    to_hf: Callable[[Tensors, ModelConfig], Tensors]

    def then(self, other: "Transform") -> "Transform":
        """`self` first towards megatron-core, then `other`; the inverse runs them backwards."""
        return Transform(f"{self.name}+{other.name}",
                         lambda ts, c: other.to_mcore(self.to_mcore(ts, c), c),
                         lambda ts, c: self.to_hf(other.to_hf(ts, c), c))


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Separate q, k, v (weights [rows, hidden] or biases [rows]) -> megatron-core's per-group layout."""
    ng, hn = config.num_query_groups, config.kv_channels
    tail = q.shape[1:]  # (hidden,) for weights, () for biases
    q = q.reshape(ng, -1, *tail)
    k, v = k.reshape(ng, hn, *tail), v.reshape(ng, hn, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def split_qkv(qkv: torch.Tensor, config: ModelConfig) -> Tensors:
    """Inverse of `fuse_qkv`."""
    ng, hn = config.num_query_groups, config.kv_channels
    q_rows = config.num_attention_heads // ng * hn
    tail = qkv.shape[1:]
    grouped = qkv.reshape(ng, q_rows + 2 * hn, *tail)
    q = grouped[:, :q_rows].reshape(-1, *tail)
    k = grouped[:, q_rows:q_rows + hn].reshape(-1, *tail)
    v = grouped[:, q_rows + hn:].reshape(-1, *tail)
    return q.contiguous(), k.contiguous(), v.contiguous()


def _qkv_sizes(config: ModelConfig) -> list[int]:
    hn = config.kv_channels
    return [config.num_attention_heads * hn, config.num_query_groups * hn, config.num_query_groups * hn]


def _concat(ts: Tensors, config: ModelConfig) -> Tensors:
    return (torch.cat(ts),)


def _transpose(ts: Tensors, config: ModelConfig) -> Tensors:
    (t,) = ts
    return (t.t().contiguous(),)


def concat(parts: int) -> Transform:
    """`parts` HF tensors stacked on dim 0 (SwiGLU fc1 = [gate; up]); inverse: equal chunks."""
    return Transform(f"concat{parts}", _concat,
                     lambda ts, c: tuple(t.contiguous() for t in ts[0].chunk(parts, dim=0)))


IDENTITY = Transform("identity", lambda ts, c: ts, lambda ts, c: ts)
TRANSPOSE = Transform("transpose", _transpose, _transpose)  # Conv1D [in, out] <-> Linear [out, in]
FUSE_QKV = Transform("fuse_qkv", lambda ts, c: (fuse_qkv(*ts, c),), lambda ts, c: split_qkv(ts[0], c))
# one HF tensor [q; k; v] (GPT-2's c_attn, phi3's qkv_proj) -> three
UNPACK_QKV = Transform("unpack_qkv", lambda ts, c: tuple(ts[0].split(_qkv_sizes(c), dim=0)), _concat)
PACKED_QKV = UNPACK_QKV.then(FUSE_QKV)
GATE_UP = concat(2)


# ------------------------------------------------------------------------------ the table

_FLAGS = {f.name for f in dataclasses.fields(ModelConfig)} | {
    name for name, value in vars(ModelConfig).items() if isinstance(value, property)}


@dataclass(frozen=True)
class Row:
    """One megatron-core tensor <- HF tensor(s) through `transform`; `{i}` = layer number."""

    mcore: str
    hf: tuple[str, ...] | str
    transform: Transform = IDENTITY
    when: str | None = None  # a ModelConfig flag ("add_qkv_bias") or its negation ("not tie_word_embeddings")

    def __post_init__(self) -> None:
        if isinstance(self.hf, str):
            object.__setattr__(self, "hf", (self.hf,))
        if self.when is not None and self.when.removeprefix("not ") not in _FLAGS:
            raise ValueError(f"Row {self.mcore}: when={self.when!r} names no ModelConfig field")
        layered = ["{i}" in name for name in (self.mcore, *self.hf)]
        if any(layered) and not all(layered):
            raise ValueError(f"Row {self.mcore}: '{{i}}' must be in the megatron-core name and every HF name, or none")

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.mcore

    def exists(self, config: ModelConfig) -> bool:
        if self.when is None:
            return True
        flag = self.when.removeprefix("not ")
        return bool(getattr(config, flag)) != self.when.startswith("not ")


def edit_rows(rows: Iterable[Row], drop: Iterable[str] = (), after: dict[str, tuple[Row, ...]] | None = None
              ) -> tuple[Row, ...]:
    """A family's table from another's: rows whose megatron-core name is in `drop` left out, the
    rows of `after[name]` inserted right after row `name` (names as in the table, with `{i}`)."""
    drop, after = set(drop), dict(after or {})
    out: list[Row] = []
    for row in rows:
        if row.mcore not in drop:
            out.append(row)
        out.extend(after.pop(row.mcore, ()))
    if after:
        raise ValueError(f"edit_rows: no row {sorted(after)} to insert after")
    return tuple(out)


def expand(rows: Iterable[Row], config: ModelConfig, layers: Iterable[int] | None = None
           ) -> Iterator[tuple[str, tuple[str, ...], Transform]]:
    """(megatron-core name, HF names, transform) of every tensor, in table order; a run of
    per-layer rows is repeated for each of `layers` (default all)."""
    layers = list(range(config.num_layers) if layers is None else layers)
    block: list[Row] = []

    def flush():
        for i in layers:
            for row in block:
                yield row.mcore.format(i=i), tuple(n.format(i=i) for n in row.hf), row.transform
        block.clear()

    for row in rows:
        if not row.exists(config):
            continue
        if row.per_layer:
            block.append(row)
            continue
        yield from flush()
        yield row.mcore, row.hf, row.transform
    yield from flush()


def hf_to_mcore(rows: Iterable[Row], get: Getter, config: ModelConfig, layers=None) -> Iterator[Pair]:
    for mcore, hf, transform in expand(rows, config, layers):
        (tensor,) = transform.to_mcore(tuple(get(name) for name in hf), config)
        yield mcore, tensor


def mcore_to_hf(rows: Iterable[Row], get: Getter, config: ModelConfig, layers=None) -> Iterator[Pair]:
    for mcore, hf, transform in expand(rows, config, layers):
        yield from zip(hf, transform.to_hf((get(mcore),), config), strict=True)


# ------------------------------------------------------------------------------ the record


@dataclass(frozen=True)
class Architecture:
    """Everything hf_megatron knows about one model family.

    model_type          transformers' `model_type` ("llama")
    hf_classes          its causal-LM class names; the first is written to config.json `architectures`
    adapter             HF config dict -> ModelConfig keyword arguments (raises ConfigError on
                        fields we cannot honour)
    weights             the weight-mapping table (rows); both directions derive from it
    plan                ModelConfig -> parallel plan {module pattern: Shard}
    from_megatron_args  MegatronArgs -> the family's HF config dict (model_type and architectures
                        are added by the registry), or None when the flags are not this family's
    hf_unused           regexes of stored HF tensors the model has no place for and transformers
                        loads past without a word (its class's `_keys_to_ignore_on_load_unexpected`);
                        RoPE families add `rotary_emb.inv_freq` (see `unused_hf_tensors`)
    """

    model_type: str
    hf_classes: tuple[str, ...]
    adapter: Callable[[dict[str, Any]], dict[str, Any]]
    weights: tuple[Row, ...]
    plan: Callable[[ModelConfig], dict[str, Shard]] = gpt_plan
    from_megatron_args: Callable[["MegatronArgs"], dict[str, Any] | None] | None = None
    hf_unused: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for side, names in (("megatron-core", [row.mcore for row in self.weights]),
                            ("HF", [name for row in self.weights for name in row.hf])):
            repeated = sorted({name for name in names if names.count(name) > 1})
            if repeated:
                raise ValueError(f"{self.model_type}: {side} name(s) {repeated} in more than one row")

    @property
    def hf_class(self) -> str:
        return self.hf_classes[0]

    def hf_to_mcore(self, get: Getter, config: ModelConfig, layers=None) -> Iterator[Pair]:
        return hf_to_mcore(self.weights, get, config, layers)

    def mcore_to_hf(self, get: Getter, config: ModelConfig, layers=None) -> Iterator[Pair]:
        return mcore_to_hf(self.weights, get, config, layers)

    def hf_names(self, config: ModelConfig, mcore: str) -> tuple[str, ...]:
        """The HF tensor name(s) of megatron-core tensor `mcore` (a full name, layer number filled in)."""
        for name, hf, _ in expand(self.weights, config):
            if name == mcore:
                return hf
        raise KeyError(mcore)

    def unused_hf_tensors(self, config: ModelConfig) -> "re.Pattern[str]":
        """Stored HF tensor names to pass over (what transformers ignores on load): the family's
        `hf_unused`, and the per-layer `rotary_emb.inv_freq` buffers older checkpoints of RoPE
        models hold (transformers' `_adjust_missing_and_unexpected_keys` drops those too)."""
        patterns = list(self.hf_unused)
        if config.position_embedding_type == "rope":
            patterns.append(r"rotary_emb\.inv_freq$")
        return re.compile("|".join(f"(?:{p})" for p in patterns) or r"(?!)")


# ------------------------------------------------------------------------------ shared readers

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_fields(data: dict[str, Any]) -> dict[str, Any]:
    """Read RoPE settings from transformers >= 5 (`rope_parameters`) or 4.x (`rope_theta`, `rope_scaling`)."""
    params = dict(data.get("rope_parameters") or {})
    if not params:
        params = dict(data.get("rope_scaling") or {})
        if "rope_theta" in data:
            params["rope_theta"] = data["rope_theta"]
    theta = float(params.pop("rope_theta", data.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"unsupported rope type {rope_type!r} (rope_parameters/rope_scaling); "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("partial_rotary_factor != 1.0 is not supported")
    params["rope_type"] = rope_type
    params.pop("type", None)
    return {"rotary_base": theta, "rope_scaling": None if rope_type == "default" else params}


class MegatronArgs:
    """The `args` of a checkpoint Megatron-LM wrote (a Namespace or a dict), with the fields every
    family's recogniser reads resolved once (Megatron-LM's defaults where a flag is absent)."""

    def __init__(self, args: Any, vocab_size: int | None = None) -> None:
        self.args = args
        missing = [n for n in ("num_layers", "hidden_size", "num_attention_heads") if self.get(n) is None]
        if missing:
            raise ConfigError(f"checkpoint args lack {', '.join(missing)}; cannot tell the architecture")
        self.num_layers = self.get("num_layers")
        self.hidden = self.get("hidden_size")
        self.heads = self.get("num_attention_heads")
        stated = self.get("vocab_size")  # a NullTokenizer's --vocab-size N: N + 1 ids with its eod N
        stated = stated and stated + null_tokenizer_eod(self.get("tokenizer_type"))
        self.vocab = vocab_size or stated or self.get("padded_vocab_size")
        if not self.vocab:
            raise ConfigError("checkpoint args lack padded_vocab_size; pass the vocabulary size")
        self.ffn = self.get("ffn_hidden_size") or 4 * self.hidden
        self.max_positions = self.get("max_position_embeddings")
        self.normalization = self.get("normalization", "LayerNorm")
        self.positions = self.get("position_embedding_type", "learned_absolute")
        self.swiglu = bool(self.get("swiglu", False))
        self.eps = self.get("norm_epsilon", self.get("layernorm_epsilon", 1e-5))
        self.bias_linear = bool(self.get("add_bias_linear", True))
        self.qkv_bias = bool(self.get("add_qkv_bias", False))

    def get(self, name: str, default: Any = None) -> Any:
        return self.args.get(name, default) if isinstance(self.args, dict) else getattr(self.args, name, default)

    def describe(self) -> str:
        return (f"normalization={self.normalization}, position_embedding_type={self.positions}, "
                f"swiglu={self.swiglu}")

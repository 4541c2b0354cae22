"""Optimizer state across a layout change: `hf-megatron reshard --with-optimizer`.

A training checkpoint's optimizer state is, per model-parallel rank (t, p), a parameter state
(optimizer_state.py): fp32 main weights and Adam moments, flat over that rank's params in the
optimizer's `model_params` order, plus the step. Each source rank's state (distrib_optim.pt in
megatron-core's layout or our earlier flat one, the former ZeRO-1 files, or a full state in
model_optim_rng.pt: optimizer_files.parameter_state_of, as a resume reads it) is cut
back into named per-param tensors shaped like that rank's weight shards; then every key X in (param,
exp_avg, exp_avg_sq) is moved exactly as the weights are:

    X_full(name) = merge_tensor(name, [X_t(name) for source tp ranks t])   (vocab padding cut)
    X_target     = split_tensor(name, X_full, config, tp)[target tp rank]   (padding rows: 0)

(QKV per query group, SwiGLU [gate_r; up_r], vocab rows, row/column dims: parallel/sharding.py;
a last stage's copy of tied embeddings takes the embedding's state, as its weight does:
tied_embedding.source_name).
Adam is elementwise, so moments split like their weights resume the same steps.  The order of
params on either side comes from a meta-device model of that layout (`param_groups`, the order
MixedPrecisionOptimizer steps them in), never from the file.

Output, per target rank, what `hf-megatron train --save` writes for the target's optimizer:
distributed (`--use-distributed-optimizer`) -- distrib_optim.pt in megatron-core's layout for the
target's grad buffers (megatron_distrib_optim.empty_megatron_state over the target rank's params,
the bucket flags recorded in args: grad_buffer_args) and DistributedOptimizer.state_dict()'s entry
(distributed_optimizer_entry); plain -- Megatron-LM's FP32Optimizer / Float16OptimizerWithFloat16Params
entry with the state (megatron_optimizer_layout.to_megatron, state numbered in megatron-core's param
order).  Param groups' hyper-parameters and the loss scaler come from the source's entry (any
layout); then the LR scheduler, RNG (reshard_rng.py) and the data position.  The target's
choice (distributed or not, bucket flags) is the source's unless the command says otherwise.

Memory: the source ranks one target pipeline stage reads (mmap where the file allows), one target
rank's state (twice while its file is filled), and one full tensor at a time.  Only Megatron's two
default param groups are understood (what `hf-megatron train` builds); other groupings are refused.
"""
from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.args import FIELDS, build_args
from ..checkpoint.files import MODEL_FILE, rank_dir_name, save_atomic
from ..checkpoint.mcore import MegatronCheckpoint
from ..checkpoint.names import layer_index, to_stage_global
from ..checkpoint.unpickle import safe_load
from ..errors import CheckpointError
from ..loading import build_model
from ..parallel.sharding import merge_tensor, split_tensor
from .megatron_distrib_optim import distributed_optimizer_entry, empty_megatron_state, grad_buffer_args, megatron_layout
from .megatron_optimizer_layout import inner_state, megatron_groups, to_megatron
from .optimizer import param_groups
from .optimizer_files import DISTRIB_OPTIM_FILE, optimizer_entry, parameter_state_of
from .optimizer_state import MOMENTS, STATE_KEYS
from .reshard_rng import first_entry, resharded_rng_entry
from .tied_embedding import EMBEDDING, TIED_COPY, source_name

NEEDS_OPTIMIZER = "--with-optimizer needs a training checkpoint saved with its optimizer"  # optimizer_entry's remedy


# ------------------------------------------------------------------ param order of a layout

def stage_param_order(config, pp: int, vpp: int, stage: int, layers_per_chunk: list[int] | None = None
                      ) -> tuple[list[str], list[int], list]:
    """(names in `model_params` order, size of each param group, the meta chunks) of pipeline
    stage `stage`.  Built at tp=1: tensor parallelism changes shapes, not names or order."""
    chunks = [build_model(config, stage=v * pp + stage, num_stages=pp * vpp, layers_per_stage=layers_per_chunk,
                          tp_group=None, device="meta", init=False) for v in range(vpp)]
    name_of = {id(p): n for chunk in chunks for n, p in chunk.named_parameters()}
    groups = param_groups(chunks, weight_decay=0.0)
    return [name_of[id(p)] for g in groups for p in g["params"]], [len(g["params"]) for g in groups], chunks


def rank_layout(config, pp: int, chunks, tensors: dict[str, torch.Tensor], args, stage: int):
    """megatron-core's grad buffers of one rank (megatron_distrib_optim.megatron_layout): the meta chunks'
    params in their order, each standing as `tensors[name]` (its shape and dtype: a loaded weight shard,
    or a stand-in of the target shard's); the tied word embedding of a pipeline-parallel model in a
    bucket of its own (parallel/pipeline.tied_embedding_params' rule)."""
    named = [[(n, tensors[n]) for n, p in chunk.named_parameters() if p.requires_grad] for chunk in chunks]
    alone = set()
    if pp > 1 and config.tie_word_embeddings:
        if chunks[0].pre_process:
            alone.add(id(tensors[EMBEDDING]))
        if chunks[-1].post_process:
            alone.add(id(tensors[TIED_COPY]))
    return megatron_layout(named, args, stage, alone)


# ------------------------------------------------------------------ optimizer entries

def source_hyper_parameters(entry: dict, group_count: int, where: Path) -> tuple[list[dict], dict | None]:
    """(param groups without their params, loss scaler state or None) of a source optimizer entry in
    any layout; its groups must be the resharded rank's (`group_count`: Megatron's decay / no-decay)."""
    groups = inner_state(entry, where)["param_groups"]
    if len(groups) != group_count:
        raise CheckpointError(f"{where}: optimizer entry has {len(groups)} param groups, the resharded rank has "
                              f"{group_count} (Megatron's decay / no-decay groups)")
    scaler = entry.get("grad_scaler")
    return ([{k: copy.deepcopy(v) for k, v in g.items() if k not in ("params", "step")} for g in groups],
            copy.deepcopy(scaler) if isinstance(scaler, dict) else None)


# ------------------------------------------------------------------ source ranks

def _layers_per_chunk(ckpt: MegatronCheckpoint) -> list[int]:
    """Layers of each source model chunk c = v * pp + p, from where the reader found them."""
    counts = [set() for _ in range(ckpt.pp * ckpt.vpp)]
    for name, (p, v, _) in ckpt.where.items():
        if (index := layer_index(name)) is not None:
            counts[v * ckpt.pp + p].add(index)
    return [len(c) for c in counts]


class SourceOptimizer:
    """Named per-param optimizer state of the source checkpoint's ranks."""

    def __init__(self, ckpt: MegatronCheckpoint) -> None:
        self.ckpt, self.config = ckpt, ckpt.config
        self.layers_per_chunk = _layers_per_chunk(ckpt)
        self.step: int | None = None
        self.dtypes: dict[str, torch.dtype] = {}  # each param's model dtype (its weight's)

    def file(self, tp_rank: int, stage: int) -> Path:
        return self.ckpt.folder / rank_dir_name(tp_rank, stage, self.ckpt.pp) / MODEL_FILE

    def payload(self, tp_rank: int, stage: int) -> dict:
        return safe_load(self.file(tp_rank, stage), mmap=True)

    def rank_state(self, tp_rank: int, stage: int) -> dict[str, dict[str, torch.Tensor]]:
        """{global param name: {param, exp_avg, exp_avg_sq}} of source rank (tp_rank, stage)."""
        path = self.file(tp_rank, stage)
        names, group_sizes, chunks = stage_param_order(self.config, self.ckpt.pp, self.ckpt.vpp, stage,
                                                       self.layers_per_chunk)
        weights = {}
        for chunk, state in zip(chunks, self.ckpt.rank_state(tp_rank, stage)):
            weights.update(to_stage_global(state, chunk.layer_numbers))
        missing = [n for n in names if n not in weights]
        if missing:
            raise CheckpointError(f"{path}: weights {missing[:3]} of the optimizer's params are missing")
        model_params = [weights[n] for n in names]
        # Megatron-LM's layout numbers its state in megatron-core's param order (index-based, so the
        # meta chunks' order holds for the loaded weights too)
        order = megatron_groups(chunks, [g["params"] for g in param_groups(chunks, weight_decay=0.0)])
        layout = lambda: self._megatron_layout(chunks, weights, stage)  # noqa: E731 (only for megatron-core's file)
        _, ps = parameter_state_of(path, self.payload(tp_rank, stage), model_params, order, layout, NEEDS_OPTIMIZER,
                                   group_sizes)
        step = int(ps["step"])
        if self.step is not None and step != self.step:
            raise CheckpointError(f"{path}: optimizer step {step}, other ranks' is {self.step}")
        self.step = step
        out, at = {}, 0
        for name, weight in zip(names, model_params):
            self.dtypes.setdefault(name, weight.dtype)
            out[name] = {k: ps[k][at:at + weight.numel()].view(weight.shape) for k in STATE_KEYS}
            at += weight.numel()
        return out

    def _megatron_layout(self, chunks, weights: dict[str, torch.Tensor], stage: int):
        return rank_layout(self.config, self.ckpt.pp, chunks, weights, self.ckpt.args, stage)


# ------------------------------------------------------------------ target ranks

GRAD_BUFFER_KEYS = (*grad_buffer_args(False, False, None), "ddp_num_buckets")


class ResumableReshard:
    """What `conversion.convert.reshard` asks of a training-state carrier (see its docstring).

    `distributed`: whether the target resumes with the distributed optimizer (None: as the source
    ran); `overlap_grad_reduce` / `ddp_bucket_size`: the target's grad-buffer flags, which fix the
    layout of its distrib_optim.pt (None: the source's)."""

    def __init__(self, ckpt, tp: int, pp: int, vpp: int | None, distributed: bool | None = None,
                 overlap_grad_reduce: bool | None = None, ddp_bucket_size: int | None = None) -> None:
        if not isinstance(ckpt, MegatronCheckpoint):
            raise CheckpointError(f"{ckpt.folder}: --with-optimizer reads torch-format training checkpoints "
                                  f"(mp_rank_* folders), not {type(ckpt).__name__}")
        self.ckpt, self.config, self.tp, self.pp, self.vpp = ckpt, ckpt.config, tp, pp, vpp or 1
        self.source = SourceOptimizer(ckpt)
        self._order: dict[int, tuple] = {}
        first = self.source.payload(0, 0)
        optimizer_entry(first, self.source.file(0, 0), NEEDS_OPTIMIZER)
        dtype = self._check_dtypes(first)
        source_args = ckpt.args or argparse.Namespace()
        if distributed is None:
            distributed = bool(getattr(source_args, "use_distributed_optimizer", False)) or \
                (self.source.file(0, 0).parent / DISTRIB_OPTIM_FILE).is_file()
        self.distributed = distributed
        self.args = self._run_args(source_args, distributed, overlap_grad_reduce, ddp_bucket_size)
        # the args the target's files are written with (the grad-buffer layout follows them)
        self.target_args = build_args(self.config, **{"params_dtype": dtype, **self.args}, tp=tp, pp=pp,
                                      vpp=vpp if self.vpp > 1 else None)
        # every target stage 0 reads source stage 0; its step is known from here on (the entries carry it)
        self._cache = {(t, 0): self.source.rank_state(t, 0) for t in range(ckpt.tp)}

    def _check_dtypes(self, first: dict) -> torch.dtype:
        """Weights stored in the dtype the args name (a bf16 run's optimizer keeps fp32 main weights
        apart from bf16 weights; an fp32 run's main weights are its weights); returns it."""
        stored = self.ckpt.get("decoder.final_layernorm.weight").dtype
        args = self.ckpt.args
        named = torch.bfloat16 if getattr(args, "bf16", False) else torch.float16 if getattr(args, "fp16", False) \
            else torch.float32
        if stored != named:
            raise CheckpointError(f"{self.source.file(0, 0)}: weights stored as {str(stored).replace('torch.', '')} "
                                  f"but args say {str(named).replace('torch.', '')} (fp16/bf16 flags); the optimizer "
                                  f"state cannot be matched to them")
        return stored

    @staticmethod
    def _run_args(args: argparse.Namespace, distributed: bool, overlap_grad_reduce: bool | None,
                  ddp_bucket_size: int | None) -> dict[str, Any]:
        """The run's own args (batch sizes, seed, split, ...; the layout fields are rebuilt) with the
        target optimizer's: a distributed one records its grad-buffer flags as `train --save` does
        (megatron_distrib_optim.grad_buffer_args), a plain one none of them."""
        source = vars(args)
        ours = {k: v for k, v in source.items()
                if k not in FIELDS and k not in ("hf_config", "hf_megatron_version") and k not in GRAD_BUFFER_KEYS}
        if distributed:
            overlap = source.get("overlap_grad_reduce", False) if overlap_grad_reduce is None else overlap_grad_reduce
            bucket = source.get("ddp_bucket_size") if ddp_bucket_size is None else ddp_bucket_size
            ours.update(grad_buffer_args(overlap, source.get("overlap_param_gather", False), bucket))
            if ddp_bucket_size is None and source.get("ddp_num_buckets"):  # Megatron-LM's other bucket rule
                ours["ddp_num_buckets"] = source["ddp_num_buckets"]
        return {**ours, "has_optimizer": True, "has_rng": True}

    def order(self, stage: int) -> tuple[list[str], list[int], list]:
        if stage not in self._order:
            self._order = {stage: stage_param_order(self.config, self.pp, self.vpp, stage)}
        return self._order[stage]

    def _target_state(self, tp_rank: int, stage: int):
        """(name, {param, exp_avg, exp_avg_sq}: fp32 shaped as the rank's weight shard, source name) of
        target rank (tp_rank, stage), in `model_params` order; the source ranks this stage reads are
        loaded once (the others released).  The tensors may be views of a merged tensor: copy them."""
        names, _, chunks = self.order(stage)
        sources = [source_name(chunks, n) for n in names]  # a last stage's tied copy: the embedding
        stages = sorted({self.ckpt.locate(s)[0] for s in sources})
        self._cache = {key: value for key, value in self._cache.items() if key[1] in stages}
        for p in stages:
            for t in range(self.ckpt.tp):
                if (t, p) not in self._cache:
                    self._cache[(t, p)] = self.source.rank_state(t, p)
        for name, src in zip(names, sources):
            p = self.ckpt.locate(src)[0]
            yield name, {key: split_tensor(src, merge_tensor(src, [self._cache[(t, p)][src][key]
                                                                   for t in range(self.ckpt.tp)], self.config),
                                           self.config, self.tp)[tp_rank].float() for key in STATE_KEYS}, src

    def rank_entries(self, tp_rank: int, stage: int) -> dict[str, Any]:
        """optimizer, opt_param_scheduler, rng_state of target rank (tp_rank, stage): the optimizer entry
        as the target's optimizer writes it (megatron-core's DistributedOptimizer.state_dict(), its
        per-param state in distrib_optim.pt: `write`; or FP32Optimizer's / Float16OptimizerWith-
        Float16Params' with the state)."""
        _, group_sizes, _ = self.order(stage)
        first = self.source.payload(0, 0)
        groups, scaler = source_hyper_parameters(first["optimizer"], len(group_sizes), self.source.file(0, 0))
        step = self.source.step or 0
        if self.distributed:  # torch's AdamW counts in a float (megatron-core saves its .item())
            optimizer = distributed_optimizer_entry(groups, float(step), scaler)
        else:
            optimizer = self._full_entry(tp_rank, stage, groups, scaler, step)
        entries = {"optimizer": optimizer}
        if isinstance(first.get("opt_param_scheduler"), dict):
            entries["opt_param_scheduler"] = copy.deepcopy(first["opt_param_scheduler"])
        seed = int(getattr(self.ckpt.args, "seed", 1234) or 1234)
        rng = resharded_rng_entry(lambda t, p: first_entry(self.source.payload(t, p).get("rng_state")), seed,
                                  tp_rank, stage, self.ckpt.tp, self.ckpt.pp)
        if rng is not None:
            entries["rng_state"] = [rng]
        return entries

    def _full_entry(self, tp_rank: int, stage: int, groups: list[dict], scaler: dict | None, step: int) -> dict:
        """Megatron-LM's entry of a plain optimizer (megatron_optimizer_layout.to_megatron, what
        MixedPrecisionOptimizer.state_dict() writes) for target rank (tp_rank, stage)."""
        _, _, chunks = self.order(stage)
        mains, low, state = [], [], {}
        for i, (_, tensors, src) in enumerate(self._target_state(tp_rank, stage)):
            mains.append(tensors["param"].clone())
            low.append(self.source.dtypes[src] != torch.float32)
            if step:  # torch's AdamW state of a param: the step count (a float tensor) and the moments
                state[i] = {"step": torch.tensor(float(step)), **{k: tensors[k].clone() for k in MOMENTS}}
        float16 = any(low) or bool(scaler and "scale" in scaler)  # a dynamic scaler: fp16
        order = megatron_groups(chunks, [g["params"] for g in param_groups(chunks, weight_decay=0.0)])[0]
        return to_megatron({"state": state, "param_groups": groups}, order, mains, low, scaler, float16, step)

    def _distrib_optim(self, tp_rank: int, stage: int) -> dict:
        """megatron-core's distrib_optim.pt of target rank (tp_rank, stage), laid out by the target's
        grad buffers (megatron_distrib_optim.empty_megatron_state)."""
        _, _, chunks = self.order(stage)
        placed = []
        stand_ins: dict[str, torch.Tensor] = {}
        for name, tensors, src in self._target_state(tp_rank, stage):
            stand_ins[name] = torch.empty(tensors["param"].shape, dtype=self.source.dtypes[src], device="meta")
            placed.append((name, {k: t.clone() for k, t in tensors.items()}))  # a view keeps a merged tensor
        ps, place = empty_megatron_state(rank_layout(self.config, self.pp, chunks, stand_ins, self.target_args, stage))
        for name, tensors in placed:
            buffers, at = place[id(stand_ins[name])]
            for key in STATE_KEYS:
                buffers[key][at:at + tensors[key].numel()] = tensors[key].reshape(-1)
        return ps

    def write(self, iter_dir: Path) -> dict[str, Any]:
        """distrib_optim.pt of every target rank when the target is distributed (its entries are
        written by `rank_entries`); one target stage's source ranks loaded at a time."""
        if self.distributed:
            for stage in range(self.pp):
                for tp_rank in range(self.tp):
                    save_atomic(self._distrib_optim(tp_rank, stage),
                                iter_dir / rank_dir_name(tp_rank, stage, self.pp) / DISTRIB_OPTIM_FILE)
        self._cache = {}
        return {"step": self.source.step or 0, "ranks": self.tp * self.pp,
                "layout": "distributed optimizer" if self.distributed else "optimizer entry"}

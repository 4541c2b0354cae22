"""Megatron's distributed optimizer (`--use-distributed-optimizer`): ZeRO-1 on the flat grad buffer.

Every bucket of the grad buffer (parallel/grad_buffer.py, n elements, padded to a multiple of
dp) is split into dp contiguous shards; dp rank r owns shard r = [r n/dp, (r+1) n/dp) of every
bucket.  Per step:

    reduce-scatter (SUM) per bucket  ->  rank r holds  g[shard r] = sum over dp ranks
    unscale, inf check, clip, AdamW on the fp32 main weights of shard r only
    copy the updated shard into the model-dtype param buffer, all-gather per bucket

A param straddling a shard boundary contributes one *fragment* (its elements inside the shard)
to each rank it touches.  Adam is elementwise, so stepping fragments gives the same numbers as
stepping whole params.  The grad norm is  sqrt(sum over fragments of ||g_f||^2)  summed over dp
and then over the model-parallel group (a fragment's norm is counted under the same rules as its
param, see optimizer.py).  Bytes per step per rank, for P params (ring collectives): today's
all-reduce 2 (dp-1)/dp x 4P; here reduce-scatter (dp-1)/dp x 4P + all-gather (dp-1)/dp x P x
(param bytes) -- see bench/dp_bytes.py.

`--overlap-param-gather`: the all-gathers are launched asynchronously after the step (first
layers first) and each module waits for its buckets in a forward pre-hook, so the gather of the
later layers overlaps the next forward (hooks per transformer layer: a layer may be a compiled
region); reading the weights any other way (state_dict, a save) waits for all of them first (a
state-dict pre-hook).

Checkpoint (megatron-core 0.16.1's layout, megatron_distrib_optim.py): `state_dict()` (into
model_optim_rng.pt) is what megatron-core's DistributedOptimizer.state_dict() holds -- the param
groups without their params, each with the step, and the loss scaler where there is one;
`parameter_state(place)` -- collective over dp -- gathers main weights and Adam moments onto dp rank
0 into megatron-core's per-grad-buffer tensors, which it writes as `distrib_optim.pt` beside
model_optim_rng.pt.  Loading takes that, our previous flat layout (optimizer_state.py), a full
optimizer state, and the per-dp-rank `optim_dp_RRR.pt` files of the former ZeRO-1.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import CheckpointError
from ..parallel import state
from ..parallel.comm import all_gather_flat
from ..parallel.compile import compiled_regions
from .megatron_distrib_optim import distributed_optimizer_entry, grad_buffer_args
from .optimizer import MixedPrecisionOptimizer
from .optimizer_state import STATE_KEYS


class DistributedOptimizer(MixedPrecisionOptimizer):
    """MixedPrecisionOptimizer whose main weights and Adam state cover this dp rank's shard."""

    sharded = True

    def __init__(self, chunks, *args, overlap_param_gather: bool = False, **kwargs) -> None:
        super().__init__(chunks, *args, **kwargs)
        self.bucket_size = kwargs.get("bucket_size")  # --ddp-bucket-size (None: Megatron's default)
        self.overlap_param_gather = overlap_param_gather
        self._forward_hooks = []
        if overlap_param_gather:
            self._install_param_gather_hooks()

    def _build_main_params(self, groups: list[dict], counted: set[int]) -> list[dict]:
        """One fragment per param that meets this rank's shard of its bucket:
        (param, lo, hi) = its flat elements [lo, hi)."""
        buffer = self.grad_buffer
        self.fragments, self.main_params, self._model_views, self._grad_views, self.norm_mask = [], [], [], [], []
        inner_groups = []
        for group in groups:
            mains = []
            for p in group["params"]:
                bucket, offset = buffer.bucket_of[id(p)], buffer.offset_of[id(p)]
                shard_lo, shard_hi = bucket.shard_range(buffer.dp_rank, buffer.dp)
                lo, hi = max(shard_lo, offset) - offset, min(shard_hi, offset + p.numel()) - offset
                if hi <= lo:
                    continue
                model_view = p.data.view(-1)[lo:hi]  # a view of the bucket's param buffer
                low = p.dtype != torch.float32
                main = model_view.detach().clone().float() if low else model_view
                self.fragments.append((p, lo, hi))
                self.main_params.append(main)
                self._model_views.append(model_view if low else None)
                self._grad_views.append(p.main_grad.view(-1)[lo:hi])
                self.norm_mask.append(id(p) in counted)
                mains.append(main)
            inner_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": mains})
        return inner_groups

    def _main_grads(self) -> list[torch.Tensor]:
        return self._grad_views

    def _norm_groups(self) -> list:
        return [self.dp_group, state.get_state().group("mp")]

    def _after_update(self) -> None:
        self.grad_buffer.start_param_gather(async_op=self.overlap_param_gather)

    # ---------------------------------------------------------------- param-gather overlap
    def _install_param_gather_hooks(self) -> None:
        """A forward pre-hook per transformer layer (for all of its params) and per other module
        holding params directly.  Per layer, not per linear: a layer may be a compiled region
        (parallel/compile.py), and a hook inside one would be traced by dynamo."""
        buffer = self.grad_buffer
        for chunk in self.chunks:
            regions = [name for name, _ in compiled_regions(chunk)]
            for name, module in chunk.named_modules():
                if any(name.startswith(region + ".") for region in regions):
                    continue  # inside a layer: the layer's hook covers it
                params = module.parameters(recurse=name in regions)
                wanted = list({id(b): b for b in (buffer.bucket_of.get(id(p)) for p in params) if b}.values())
                if wanted:
                    self._forward_hooks.append(module.register_forward_pre_hook(
                        lambda _module, _args, wanted=wanted: buffer.wait_param_gather(wanted)))
            self._forward_hooks.append(chunk.register_state_dict_pre_hook(
                lambda *_args: buffer.wait_param_gather()))

    # ---------------------------------------------------------------- checkpoint
    def megatron_args(self) -> dict:
        """The Megatron-LM flags of this optimizer's grad buffer, for the checkpoint's `args` (the
        layout of distrib_optim.pt follows them: megatron_distrib_optim.bucket_size_of); grads are
        reduced in fp32, as with --accumulate-allreduce-grads-in-fp32."""
        return grad_buffer_args(self.grad_buffer.overlap, self.overlap_param_gather, self.bucket_size)

    def state_dict(self) -> dict:
        """megatron-core's DistributedOptimizer.state_dict(): {"optimizer": {"param_groups": groups
        without "params", each with "step"}, "grad_scaler" (fp16 or a constant --loss-scale only)}.
        torch's AdamW counts steps in a float tensor, so the step is a float there (megatron-core
        takes `.item()`); an int with apex's FusedAdam, which counts per group."""
        self.grad_buffer.wait_param_gather()
        per_group = any("step" in g for g in self.optimizer.param_groups)
        step = int(self._step_count()) if per_group else float(self._step_count())
        scaler = self.scaler.state_dict() if self.scaler.active else None
        return distributed_optimizer_entry(self.optimizer.state_dict()["param_groups"], step, scaler)

    def _step_count(self) -> int:
        """AdamW steps taken (dp rank 0, whose entry is saved, holds the start of every bucket)."""
        for main in self.main_params:
            step = self.optimizer.state.get(main, {}).get("step")
            if step is not None:
                return int(step)
        return max((int(g["step"]) for g in self.optimizer.param_groups if g.get("step") is not None), default=0)

    @torch.no_grad()
    def parameter_state(self, place: dict[int, tuple[dict, int]] | None = None) -> dict | None:
        """Collective over dp: every param's main weight and Adam moments, gathered bucket by bucket
        onto dp rank 0, written into `place` there: {id(param): (tensors, offset)} -> elements
        [offset, offset + numel) of tensors["param" / "exp_avg" / "exp_avg_sq"]
        (megatron_distrib_optim.empty_megatron_state).  Without `place`, dp rank 0 gathers into our
        flat layout (optimizer_state.py) and returns it; other ranks return None."""
        flat = None
        if place is None and self.grad_buffer.dp_rank == 0:
            numels = [p.numel() for p in self.model_params]
            flat = {key: torch.zeros(sum(numels), dtype=torch.float32) for key in STATE_KEYS}
            starts = torch.tensor([0] + numels).cumsum(0).tolist()
            place = {id(p): (flat, start) for p, start in zip(self.model_params, starts)}
        self._gather_into(place)
        return None if flat is None else {"numels": numels, "step": self._step_count(), **flat}

    def _gather_into(self, place: dict[int, tuple[dict, int]] | None) -> None:
        """parameter_state's gather: per bucket and key, this rank's shard all-gathered, dp rank 0
        copying each param's elements to where `place` says."""
        buffer = self.grad_buffer
        buffer.wait_param_gather()
        mine = {id(p): (lo, main) for (p, lo, _), main in zip(self.fragments, self.main_params)}
        for bucket in buffer.buckets:
            shard_lo, shard_hi = bucket.shard_range(buffer.dp_rank, buffer.dp)
            for key in STATE_KEYS:
                local = torch.zeros(shard_hi - shard_lo, dtype=torch.float32, device=buffer.data.device)
                for p, offset in zip(bucket.params, bucket.offsets):
                    if id(p) in mine:
                        lo, main = mine[id(p)]
                        source = main if key == "param" else self.optimizer.state.get(main, {}).get(key)
                        if source is not None:
                            at = offset + lo - shard_lo
                            local[at:at + source.numel()] = source.reshape(-1)
                whole = local.new_zeros(bucket.numel)
                if buffer.dp > 1:
                    all_gather_flat(whole, local, buffer.group)
                else:
                    whole.copy_(local)
                if buffer.dp_rank == 0:
                    whole = whole.cpu()
                    for p, offset in zip(bucket.params, bucket.offsets):
                        tensors, at = place[id(p)]
                        tensors[key][at:at + p.numel()] = whole[offset:offset + p.numel()]

    def load_state_dict(self, sd: dict, parameter_state: dict | None = None) -> None:
        """`sd` as `state_dict()` wrote it (or an earlier layout's, for its hyper-parameters and
        scaler); `parameter_state` in our flat layout (optimizer_state.py; training/checkpoint.py
        converts megatron-core's distrib_optim.pt and the earlier layouts into it). Every rank
        loaded the same model weights before, so the param buffers are already whole: no gather."""
        if parameter_state is None:
            raise CheckpointError("optimizer state: the distributed optimizer needs the parameter state "
                                  "(distrib_optim.pt) next to model_optim_rng.pt")
        self.load_parameter_state(sd, parameter_state)

"""The rank grid: which ranks form each tensor / context / data / pipeline parallel group.

Ranks are laid out as ``torch.arange(world).view(pp, dp, cp, tp)`` -- Megatron's order:
tensor-parallel ranks are adjacent (fastest-varying, so a TP group sits inside one node
on NVLink), then context, then data, and pipeline stages vary slowest.  A group along
one axis is the set of ranks that differ only in that coordinate.

Before `initialize()` (or in a single process) every degree is 1 and every group is
None, so the same model code runs unchanged without torch.distributed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


from ..errors import ParallelConfigError  # noqa: E402  (re-exported)


@dataclass
class ParallelState:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    rank: int = 0
    groups: dict = field(default_factory=dict)  # axis -> ProcessGroup containing this rank
    ranks: dict = field(default_factory=dict)  # axis -> list of global ranks in that group
    coords: dict = field(default_factory=lambda: {"pp": 0, "dp": 0, "cp": 0, "tp": 0})

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def group(self, axis: str):
        return self.groups.get(axis)

    def rank_in(self, axis: str) -> int:
        return self.coords[axis]

    def size(self, axis: str) -> int:
        return getattr(self, axis)


_STATE = ParallelState()
AXES = ("pp", "dp", "cp", "tp")  # slowest -> fastest


def check_degrees(world: int, tp: int = 1, pp: int = 1, cp: int = 1, dp: int | None = None) -> int:
    """Return dp (inferred when None); raise one clear error if the degrees do not fit."""
    for name, value in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                        ("context_parallel_size", cp)):
        if value < 1:
            raise ParallelConfigError(f"{name} must be >= 1, got {value}")
    model_parallel = tp * pp * cp
    if world % model_parallel:
        raise ParallelConfigError(
            f"world size {world} is not divisible by tp({tp}) x pp({pp}) x cp({cp}) = {model_parallel}"
        )
    if dp is None:
        dp = world // model_parallel
    if dp * model_parallel != world:
        raise ParallelConfigError(
            f"world size {world} != tp({tp}) x pp({pp}) x cp({cp}) x dp({dp}) = {dp * model_parallel}"
        )
    return dp


def rank_grid(world: int, tp: int = 1, pp: int = 1, cp: int = 1) -> torch.Tensor:
    """The [pp, dp, cp, tp] grid of global ranks."""
    dp = check_degrees(world, tp, pp, cp)
    return torch.arange(world).view(pp, dp, cp, tp)


def groups_along(grid: torch.Tensor, axis: str) -> list[list[int]]:
    """Every group of ranks that differ only along `axis` (each a sorted list)."""
    dim = AXES.index(axis)
    moved = grid.movedim(dim, -1).reshape(-1, grid.shape[dim])
    return [row.tolist() for row in moved]


def initialize(tp: int = 1, pp: int = 1, cp: int = 1, backend: str | None = None) -> ParallelState:
    """Build every group. torch.distributed must be initialised (or world size 1)."""
    global _STATE
    if dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
    else:
        world, rank = 1, 0
    grid = rank_grid(world, tp, pp, cp)
    state = ParallelState(tp=tp, pp=pp, dp=grid.shape[1], cp=cp, rank=rank)
    position = (grid == rank).nonzero()[0].tolist()
    state.coords = dict(zip(AXES, position))
    axes = {axis: groups_along(grid, axis) for axis in AXES}
    # model-parallel (tp x pp x cp) and dp x cp groups, used for grad-norm and ZeRO
    axes["mp"] = [grid[:, d].reshape(-1).tolist() for d in range(grid.shape[1])]
    axes["dp_cp"] = [grid[p, :, :, t].reshape(-1).tolist() for p in range(pp) for t in range(tp)]
    if pp > 1:  # tied word embeddings: first and last stage of each tp/dp/cp position
        axes["embd"] = [[first, last] for first, last in zip(grid[0].reshape(-1).tolist(),
                                                            grid[-1].reshape(-1).tolist())]
    for axis, all_groups in axes.items():
        for ranks in all_groups:
            # every rank must call new_group for every group, in the same order
            group = dist.new_group(ranks, backend=backend) if world > 1 else None
            if rank in ranks:
                state.groups[axis] = group
                state.ranks[axis] = ranks
    _STATE = state
    return state


def get_state() -> ParallelState:
    return _STATE


def set_state(state: ParallelState) -> None:
    global _STATE
    _STATE = state


def reset() -> None:
    """Forget the groups (tests; after destroy_process_group)."""
    set_state(ParallelState())


def tp_size() -> int:
    return _STATE.tp


def tp_rank() -> int:
    return _STATE.coords["tp"]


def tp_group():
    return _STATE.groups.get("tp")

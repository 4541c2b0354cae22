"""The optimizer state of one rank folder of a training checkpoint, whichever files hold it, read
into a parameter state (optimizer_state.py): what a resume (checkpoint.load_checkpoint) and a
reshard of the optimizer (reshard_optimizer.py) both start from.  Looked for in this order:

    mp_rank_TT[_PPP]/distrib_optim.pt   the distributed optimizer's main weights and Adam moments, in
                                        megatron-core's layout (megatron_distrib_optim.py; what ours
                                        writes) or our earlier flat one (optimizer_state.py); its param
                                        groups and loss scaler: model_optim_rng.pt's optimizer entry
    mp_rank_TT[_PPP]/optim_dp_RRR.pt    the former ZeRO-1's, one per dp rank 000 .. dp-1, each entry
                                        the state of the params that rank stepped (rank 0's entry:
                                        the param groups and loss scaler)
    model_optim_rng.pt's `optimizer`    a full state: Megatron-LM's layout or our previous one

Every malformed file or entry is one CheckpointError naming the file.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from ..checkpoint.files import optim_file_name
from ..checkpoint.unpickle import safe_load
from ..errors import CheckpointError
from .megatron_distrib_optim import MegatronBuffer, is_megatron_distrib_optim, parameter_state_from_megatron
from .megatron_optimizer_layout import inner_state
from .optimizer_state import check_parameter_state, parameter_state_from

DISTRIB_OPTIM_FILE = "distrib_optim.pt"  # Megatron-LM's name: the distributed optimizer's state, from dp rank 0


def zero1_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("optim_dp_*.pt"))


def _zero1_entry(path: Path) -> dict:
    entry = safe_load(path).get("optimizer")
    if not isinstance(entry, dict):
        raise CheckpointError(f"{path}: expected an 'optimizer' entry (the state the former ZeRO-1 saved for a dp rank)")
    return entry


def kept_apart(folder: Path) -> bool:
    """Whether the rank folder keeps its per-param optimizer state in files of its own
    (distrib_optim.pt, optim_dp_RRR.pt) rather than in model_optim_rng.pt's entry."""
    return (folder / DISTRIB_OPTIM_FILE).is_file() or bool(zero1_files(folder))


def optimizer_entry(payload: dict, rank_file: Path, remedy: str) -> dict:
    """The rank file's optimizer entry; `remedy`: what the user can do without one (the caller's flags)."""
    entry = payload.get("optimizer")
    if not isinstance(entry, dict):
        raise CheckpointError(f"{rank_file}: holds no optimizer state (no optimizer entry: a converted or "
                              f"weights-only checkpoint); {remedy}")
    return entry


def parameter_state_of(rank_file: Path, payload: dict, model_params: list[torch.Tensor], order,
                       layout: Callable[[], list[MegatronBuffer]], remedy: str,
                       group_sizes: list[int] | None = None) -> tuple[dict, dict]:
    """(the optimizer entry with the param groups and loss scaler, the parameter state of
    `model_params`) of the rank file `rank_file` (loaded: `payload`) and the files beside it.

    `order`: the optimizer's `megatron_order` (megatron_optimizer_layout.megatron_groups), which a
    full state in Megatron-LM's layout is numbered by; `layout()`: megatron-core's grad buffers of the
    rank (megatron_distrib_optim.megatron_layout), asked for only to read megatron-core's
    distrib_optim.pt; `remedy`: optimizer_entry's; `group_sizes`, when given: the sizes a full
    state's param groups must have (a reshard's default groups)."""
    folder = rank_file.parent
    zero1 = zero1_files(folder)
    try:
        if (folder / DISTRIB_OPTIM_FILE).is_file():
            entry = payload.get("optimizer")
            if not isinstance(entry, dict):
                raise CheckpointError(f"no optimizer entry (param groups, loss scaler) beside {DISTRIB_OPTIM_FILE}")
            ps = safe_load(folder / DISTRIB_OPTIM_FILE, mmap=True)  # read-only here: every reader copies
            if is_megatron_distrib_optim(ps):  # megatron-core's layout (what ours writes too)
                return entry, parameter_state_from_megatron(ps, entry, layout(), model_params,
                                                            folder / DISTRIB_OPTIM_FILE)
            check_parameter_state(ps, model_params)  # our earlier flat layout
            return entry, ps
        if zero1:
            if [f.name for f in zero1] != [optim_file_name(r) for r in range(len(zero1))]:
                raise CheckpointError(f"{folder}: optimizer files {[f.name for f in zero1]} are not "
                                      f"optim_dp_000.pt .. optim_dp_{len(zero1) - 1:03d}.pt")
            states = [_zero1_entry(f) for f in zero1]
            return states[0], parameter_state_from(states, model_params, order)
        entry = optimizer_entry(payload, rank_file, remedy)
        if group_sizes is not None:
            saved = [len(g.get("params", ())) for g in inner_state(entry)["param_groups"]]
            if saved != group_sizes:
                raise CheckpointError(f"optimizer param groups of {saved} params, the model's default groups have "
                                      f"{group_sizes} (custom param groups cannot be resharded)")
        return entry, parameter_state_from([entry], model_params, order)
    except CheckpointError as exc:
        message = str(exc)
        raise CheckpointError(message if message.startswith(str(folder)) else f"{rank_file}: {message}") from None
    except (KeyError, TypeError, AttributeError, ValueError) as exc:  # an entry not shaped as written
        raise CheckpointError(f"{rank_file}: optimizer state not in the expected layout ({exc!r})") from None

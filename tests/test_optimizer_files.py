"""The optimizer layouts earlier versions wrote, read by optimizer_files.parameter_state_of (what a
resume and `reshard --with-optimizer` both read a rank folder with): our earlier flat
distrib_optim.pt and the former ZeRO-1's optim_dp_RRR.pt files.  A run saved at SAVE_AT, its rank
folder rewritten into the old layout and resumed in fresh objects, has the losses of the
uninterrupted run bit for bit (one process, fp32; the ZeRO-1 files as two dp ranks wrote them).
Bad files are one error naming the file."""
from __future__ import annotations

import pytest
import torch

from hf_megatron.checkpoint.files import save_atomic
from hf_megatron.checkpoint.unpickle import safe_load
from hf_megatron.errors import CheckpointError
from hf_megatron.parallel import state
from hf_megatron.training.optimizer_state import MOMENTS, parameter_state_from
from test_checkpoint_resume import SAVE_AT, model_config, training_config
from test_distributed_optimizer import _switch

MODEL_FILE = "model_optim_rng.pt"


def _saved_state(rank_dir, optimizer) -> tuple[dict, dict]:
    """(the rank file's payload, the parameter state of its full optimizer entry)."""
    payload = safe_load(rank_dir / MODEL_FILE)
    return payload, parameter_state_from([payload["optimizer"]], optimizer.model_params, optimizer.megatron_order)


def flat_distrib_optim(rank_dir, optimizer) -> None:
    """Our earlier distributed optimizer's files: the parameter state as is in distrib_optim.pt, the
    entry in model_optim_rng.pt with its param groups only."""
    payload, ps = _saved_state(rank_dir, optimizer)
    save_atomic(ps, rank_dir / "distrib_optim.pt")
    payload["optimizer"]["state"] = {}  # FP32Optimizer's entry (fp32): the moments must come from distrib_optim.pt
    save_atomic(payload, rank_dir / MODEL_FILE)


def zero1_files(rank_dir, optimizer, dp: int = 2) -> None:
    """The former ZeRO-1's files: dp rank r stepped the params dealt to it (largest first onto the
    least-loaded rank; ties: lower index, lower rank), its AdamW state numbered over its own params
    in model_params order; model_optim_rng.pt without an optimizer entry."""
    payload, ps = _saved_state(rank_dir, optimizer)
    shapes = [p.shape for p in optimizer.model_params]
    numels = ps["numels"]
    starts = torch.tensor([0, *numels]).cumsum(0).tolist()
    load, owned = [0] * dp, [[] for _ in range(dp)]
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        rank = min(range(dp), key=lambda r: (load[r], r))
        owned[rank].append(i)
        load[rank] += numels[i]
    groups = payload["optimizer"]["param_groups"]  # hyper-parameters only: matched by megatron-core's keys
    for rank, mine in enumerate(owned):
        adam = {j: {"step": torch.tensor(float(ps["step"])),
                    **{k: ps[k][starts[i]:starts[i] + numels[i]].view(shapes[i]).clone() for k in MOMENTS}}
                for j, i in enumerate(sorted(mine))}
        entry = {"optimizer": {"state": adam, "param_groups": groups}, "fp32_from_fp16_params": []}
        save_atomic({"optimizer": entry, "iteration": SAVE_AT}, rank_dir / f"optim_dp_{rank:03d}.pt")
    payload["optimizer"] = None
    save_atomic(payload, rank_dir / MODEL_FILE)


@pytest.mark.parametrize("rewrite", [flat_distrib_optim, zero1_files])
def test_earlier_layouts_resume_with_the_uninterrupted_losses(rewrite, tmp_path):
    state.reset()
    plain = training_config()
    uninterrupted, resumed = _switch(plain, plain, model_config(), tmp_path, rewrite)
    assert resumed == uninterrupted and len(set(uninterrupted)) == len(uninterrupted)
    state.reset()


def test_bad_files_of_earlier_layouts_are_one_line_naming_the_file(tmp_path):
    from hf_megatron.training.optimizer_files import parameter_state_of
    state.reset()
    plain = training_config()
    trained = []

    def rewrite(rank_dir, optimizer):
        zero1_files(rank_dir, optimizer)
        trained.append(optimizer)  # its model_params and megatron_order: what parameter_state_of is given

    _switch(plain, plain, model_config(), tmp_path / "zero1", rewrite)
    rank_dir, (optimizer,) = tmp_path / "zero1" / f"iter_{SAVE_AT:07d}" / "mp_rank_00", trained

    def error() -> str:
        payload = safe_load(rank_dir / MODEL_FILE)
        with pytest.raises(CheckpointError) as info:
            parameter_state_of(rank_dir / MODEL_FILE, payload, optimizer.model_params, optimizer.megatron_order,
                               lambda: None, "load it without an optimizer")
        assert "\n" not in str(info.value)
        return str(info.value)

    save_atomic({"iteration": SAVE_AT}, rank_dir / "optim_dp_001.pt")
    assert error() == f"{rank_dir / 'optim_dp_001.pt'}: expected an 'optimizer' entry (the state the former ZeRO-1 " \
                      "saved for a dp rank)"
    (rank_dir / "optim_dp_001.pt").rename(rank_dir / "optim_dp_002.pt")
    assert error().startswith(f"{rank_dir}: optimizer files ['optim_dp_000.pt', 'optim_dp_002.pt'] are not "
                              "optim_dp_000.pt .. optim_dp_001.pt")
    for f in rank_dir.glob("optim_dp_*"):
        f.unlink()
    assert error().startswith(f"{rank_dir / MODEL_FILE}: holds no optimizer state (no optimizer entry: a converted or "
                              "weights-only checkpoint); load it without an optimizer")
    save_atomic({"numels": [3], "step": 1, "param": torch.zeros(3)}, rank_dir / "distrib_optim.pt")
    payload = safe_load(rank_dir / MODEL_FILE)
    payload["optimizer"] = {"param_groups": []}
    save_atomic(payload, rank_dir / MODEL_FILE)
    assert error() == f"{rank_dir / MODEL_FILE}: distrib_optim.pt: expected keys numels, step, param, exp_avg, exp_avg_sq"
    state.reset()

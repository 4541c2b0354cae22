"""The user's RNG under our Accelerator is plain accelerate's: set_seed, prepare(model, optimizer,
loader), then the shuffle order and the script's own torch draws after prepare are those of the
same code under plain accelerate, and load_state restores the user's generator as save_state found
it (one process
on CPU); at tp2 the two tensor-parallel ranks still draw the same replicated dropout masks (losses
equal across the ranks of one replica) whatever each rank's user generator holds."""
from __future__ import annotations

import os

import pytest
import torch

from dist import run_distributed
from test_accelerate_state import _blocks, _env, _reset_accelerate


def _script(rank, world, megatron: bool, folder: str, user_seed_offset: int = 0):
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader

    from tiny import tiny_hf_model
    if megatron:
        from hf_megatron import Accelerator
        _env(world, 1, num_micro=1)
    else:
        from accelerate import Accelerator
        for key in [k for k in os.environ if k.startswith(("ACCELERATE_", "MEGATRON_LM_"))]:
            del os.environ[key]
        os.environ["ACCELERATE_USE_CPU"] = "true"
    _reset_accelerate()
    accelerator = Accelerator()
    model = tiny_hf_model("gpt2", resid_pdrop=0.1, embd_pdrop=0.1)  # (seeds torch itself)
    set_seed(42 + user_seed_offset * rank)  # an offset: each rank's user generator its own
    data = [{"input_ids": b, "labels": b, "index": torch.tensor(i)}
            for i, b in enumerate(_blocks(8, model.config.vocab_size, seed=5))]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=2, shuffle=True))
    out = {"after_prepare": torch.rand(3).tolist()}
    order, losses = [], []
    model.train()
    for batch in loader:
        order += batch.pop("index").tolist()
        losses.append(model(**batch).loss.item())
        optimizer.step()
        optimizer.zero_grad()
    out.update(order=order, after_epoch=torch.rand(3).tolist(), losses=losses)
    accelerator.save_state(folder)
    saved_next = torch.rand(3).tolist()
    torch.rand(5)
    accelerator.load_state(folder)
    out.update(after_load=torch.rand(3).tolist(), saved_next=saved_next)
    return out


def test_set_seed_shuffle_and_draws_after_prepare_are_plain_accelerates(tmp_path):
    (plain,) = run_distributed(_script, world_size=1, args=(False, str(tmp_path / "plain")))
    (ours,) = run_distributed(_script, world_size=1, args=(True, str(tmp_path / "ours")))
    for key in ("after_prepare", "order"):
        assert ours[key] == plain[key], (key, ours[key], plain[key])
    # load_state puts back the user's generator as save_state found it, in both (plain's dropout drew from
    # it during the epoch, ours from the engine's own stream: the values themselves differ by that)
    assert plain["after_load"] == plain["saved_next"]
    assert ours["after_load"] == ours["saved_next"]


@pytest.mark.slow  # 2 processes through accelerate, ~19 s
def test_tp2_ranks_share_dropout_and_keep_plain_user_rng(tmp_path):
    """tp2 (dp 1): each rank's user generator seeded differently; the draws after prepare are what
    that seed gives under plain accelerate, and both ranks of the replica compute one loss."""
    (plain,) = run_distributed(_script, world_size=1, args=(False, str(tmp_path / "plain")))
    ours = run_distributed(_script, world_size=2, args=(True, str(tmp_path / "ours"), 1))
    assert ours[0]["after_prepare"] == plain["after_prepare"]  # rank 0: set_seed(42), as plain
    assert ours[0]["order"] == plain["order"]
    assert ours[1]["after_prepare"] != ours[0]["after_prepare"]  # rank 1's own user stream ...
    assert ours[0]["losses"] == ours[1]["losses"]  # ... yet the replica's dropout masks agree

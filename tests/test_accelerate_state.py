"""The Accelerator's Megatron-LM path in-process on gloo workers (no `accelerate launch`):
save_state / load_state round trips, eval of any batch size, return_logits, gather_for_metrics over
the data-parallel group, and the one-line errors."""
from __future__ import annotations

import os

import pytest
import torch

from dist import run_distributed

SEQ = 16


def _env(tp: int, pp: int, num_micro: int = 2):
    os.environ.update(ACCELERATE_USE_MEGATRON_LM="true", MEGATRON_LM_TP_DEGREE=str(tp),
                      MEGATRON_LM_PP_DEGREE=str(pp), MEGATRON_LM_NUM_MICRO_BATCHES=str(num_micro),
                      MEGATRON_LM_SEQUENCE_PARALLELISM=str(tp > 1).lower(), MEGATRON_LM_GRADIENT_CLIPPING="1.0",
                      ACCELERATE_USE_CPU="true")


def _reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState, PartialState
    AcceleratorState._reset_state(True), GradientState._reset_state(), PartialState._reset_state()


def _blocks(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def _setup(tp, pp, arch="gpt2", shuffle=True, **plugin_kwargs):
    from accelerate.utils import MegatronLMDummyScheduler, MegatronLMPlugin, set_seed
    from torch.utils.data import DataLoader

    from hf_megatron import Accelerator
    from tiny import tiny_hf_model
    _env(tp, pp)
    _reset_accelerate()
    kwargs = {"megatron_lm_plugin": MegatronLMPlugin(**plugin_kwargs)} if plugin_kwargs else {}
    accelerator = Accelerator(**kwargs)
    set_seed(3)
    model = tiny_hf_model(arch)
    data = [{"input_ids": b, "labels": b} for b in _blocks(24, model.config.vocab_size)]
    loader = DataLoader(data, batch_size=2, shuffle=shuffle)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    scheduler = MegatronLMDummyScheduler(optimizer, total_num_steps=12, warmup_num_steps=2)
    return accelerator, accelerator.prepare(model, optimizer, loader, scheduler)


def _train(model, batches, steps):
    model.train()
    return [model(**next(batches)).loss.item() for _ in range(steps)]


def _round_trip(rank, world, tp, pp, folder):
    accelerator, (model, optimizer, loader, scheduler) = _setup(tp, pp)
    batches = iter(loader)
    first = _train(model, batches, 2)
    accelerator.save_state(folder)
    after = _train(model, batches, 2)  # steps 3, 4
    weights = accelerator.get_state_dict(model)
    lr = scheduler.get_last_lr()
    accelerator.load_state(folder)  # back to step 2; the loader restarts the interrupted pass
    batches = iter(loader)
    _ = [next(batches) for _ in range(2)]  # skip what was trained on, as the example scripts do
    again = _train(model, batches, 2)
    return {"first": first, "after": after, "again": again, "weights": weights,
            "weights_again": accelerator.get_state_dict(model), "lr": lr, "lr_again": scheduler.get_last_lr()}


@pytest.mark.parametrize("tp,pp", [pytest.param(2, 2, marks=pytest.mark.slow), (1, 2)])
def test_save_state_load_state_continue_exactly(tmp_path, tp, pp):
    results = run_distributed(_round_trip, world_size=tp * pp, args=(tp, pp, str(tmp_path / "state")))
    main = results[0]
    assert main["after"] == main["again"], main
    assert main["lr"] == main["lr_again"]
    assert main["weights"].keys() == main["weights_again"].keys() and main["weights"]
    for name, tensor in main["weights"].items():
        assert torch.equal(tensor, main["weights_again"][name]), name
    assert all(r["weights"] == {} for r in results[1:])  # get_state_dict: the main process only

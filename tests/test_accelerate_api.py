"""The accelerate APIs a training script calls, run by the same script under plain accelerate and under
our Accelerator (Megatron-LM, one process on CPU, fp32), compared call by call:

* `accumulate(model)` with gradient_accumulation_steps=2 over an odd number of batches (the last
  batch of each pass syncs, as accelerate's `sync_with_dataloader`): `sync_gradients` per batch, the
  weights moving only on sync batches (optimizer.step() / zero_grad() do nothing in between), a
  transformers schedule's lr, `step_was_skipped`, the losses over two passes and the final weights;
* `clip_grad_norm_` on every batch: on a batch that only accumulates, plain accelerate returns the
  norm of the partial sum and clips it in place -- the losses after show that ours clips it too;
* `reduce` (sum / mean / max; `scale` ignored, an int tensor kept), `gather` of a 0-d tensor,
  `gather_for_metrics` of an uneven eval loader, of strings and of a dict of non-tensors;
* `init_trackers` / `log` / `end_training` with a GeneralTracker that needs no network;
* `save_state` / `load_state`: the resumed pass gives the uninterrupted pass's losses (and plain's);
* `autocast()`: nothing at fp32; at bf16 torch's CPU autocast in bf16, and `model(**batch)` inside
  gives the numbers it gives outside (plain accelerate's model is autocast already).
Slow: tp 2 and pp 2 against the same plain run (the partial sums' norm over sequence-parallel and tied-
embedding gradients); dp 2 against plain accelerate with two processes: gather_for_metrics drops the
duplicates of the last uneven batch, reduce / gather over the processes, each process's partial norm."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

from dist import run_distributed
from test_accelerate_state import _blocks, _env, _reset_accelerate

ACCUMULATE, EPOCHS = 2, 2


def _accelerate_class(megatron: bool, world: int, tp: int = 1, pp: int = 1):
    """Our Accelerator under a Megatron-LM config (tp x pp, dp the rest), or plain accelerate's as a script run by
    `python` (one process: DistributedType.NO) or `torchrun` (world > 1: MULTI_CPU) gets it."""
    if megatron:
        from hf_megatron import Accelerator
        _env(tp, pp, num_micro=1)
    else:
        from accelerate import Accelerator
        for key in [k for k in os.environ if k.startswith(("ACCELERATE_", "MEGATRON_LM_"))]:
            del os.environ[key]
        os.environ["ACCELERATE_USE_CPU"] = "true"
        if world == 1 and torch.distributed.is_initialized():  # `python script.py`: no process group at all
            torch.distributed.destroy_process_group()
            for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
                os.environ.pop(key, None)
    from hf_megatron.parallel import state
    state.reset()  # (a second Accelerator in one process: the tests build one per precision)
    _reset_accelerate()
    return Accelerator


def _list_tracker():
    from accelerate.tracking import GeneralTracker

    class ListTracker(GeneralTracker):
        """A tracker that keeps what it is given (no network, no files)."""
        name = "list"
        requires_logging_directory = False

        def __init__(self):
            super().__init__()
            self.config, self.logged, self.finished = None, [], False

        @property
        def tracker(self):
            return self.logged

        def store_init_configuration(self, values):
            self.config = dict(values)

        def log(self, values, step=None, **kwargs):
            self.logged.append((step, dict(values)))

        def finish(self):
            self.finished = True

    return ListTracker()


def _fingerprint(model) -> float:
    return sum(float(p.detach().double().sum()) for p in model.parameters())


def _train_pass(accelerator, model, optimizer, loader, scheduler, log: bool) -> dict:
    out = {key: [] for key in ("loss", "sync", "moved", "norm", "lr", "skipped", "sum", "mean", "max")}
    model.train()
    for batch in loader:
        before = _fingerprint(model)
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            out["sync"].append(accelerator.sync_gradients)
            # on every batch (not only under `if accelerator.sync_gradients`): a partial sum is clipped too
            out["norm"].append(accelerator.clip_grad_norm_(model.parameters(), 1.0).item())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        out["moved"].append(_fingerprint(model) != before)
        out["skipped"].append(optimizer.step_was_skipped)
        out["lr"].append(scheduler.get_last_lr()[0])
        out["loss"].append(loss.item())
        for reduction in ("sum", "mean", "max"):
            out[reduction].append(accelerator.reduce(loss.detach(), reduction).item())
        if log:
            accelerator.log({"loss": loss.item(), "lr": out["lr"][-1]}, step=len(out["loss"]))
    return out


def _evaluate(accelerator, model, loader) -> dict:
    model.eval()
    ids, words, losses = [], [], []
    for batch in loader:
        with torch.no_grad():
            loss = model(**batch).loss
        ids.append(accelerator.gather_for_metrics(batch["input_ids"]))
        words += accelerator.gather_for_metrics([f"s{int(x)}" for x in batch["input_ids"][:, 0]])
        losses.append(accelerator.gather_for_metrics(loss).tolist())  # 0-d: not cut
    return {"ids": torch.cat(ids), "words": words, "losses": losses}


def _api_script(rank, world, megatron: bool, folder: str, tp: int = 1, pp: int = 1) -> dict:
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader
    from transformers import get_linear_schedule_with_warmup

    from tiny import tiny_hf_model
    bf16 = _bf16_part(megatron, world, folder + "_bf16", tp, pp)
    Accelerator = _accelerate_class(megatron, world, tp, pp)
    tracker = _list_tracker()
    accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATE, log_with=[tracker])
    accelerator.init_trackers("api", config={"lr": 1e-3, "accumulate": ACCUMULATE})
    model = tiny_hf_model("gpt2")
    set_seed(0)
    data = [{"input_ids": b, "labels": b} for b in _blocks(10, model.config.vocab_size, seed=5)]  # 5 batches a pass
    loader = DataLoader(data, batch_size=2, shuffle=True)
    eval_loader = DataLoader(data[:5], batch_size=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    updates = -(-len(loader) // ACCUMULATE) * EPOCHS  # the last batch of a pass syncs: 3 updates a pass
    scheduler = get_linear_schedule_with_warmup(optimizer, 0, updates)
    model, optimizer, loader, eval_loader, scheduler = accelerator.prepare(model, optimizer, loader, eval_loader,
                                                                           scheduler)
    out = {"first": _train_pass(accelerator, model, optimizer, loader, scheduler, log=True)}
    accelerator.save_state(folder)
    out["second"] = _train_pass(accelerator, model, optimizer, loader, scheduler, log=True)
    out["eval"] = _evaluate(accelerator, model, eval_loader)
    out["weights"] = accelerator.get_state_dict(model)
    out["step"] = accelerator.step
    accelerator.load_state(folder)
    out["resumed"] = _train_pass(accelerator, model, optimizer, loader, scheduler, log=False)
    out["gather_0d"] = tuple(accelerator.gather(torch.tensor(3.0)).shape)
    out["gather_dict"] = accelerator.gather_for_metrics({"a": "x"})
    out["reduce_scaled"] = accelerator.reduce(torch.tensor(2.0), "sum", scale=3.0).item()  # accelerate: XLA only
    out["reduce_int"] = accelerator.reduce(torch.tensor([2, 1]), "sum")
    with accelerator.autocast():
        out["autocast"] = (torch.is_autocast_enabled("cpu"), (torch.ones(2, 2) @ torch.ones(2, 2)).dtype)
    accelerator.end_training()  # last: it also ends the process group
    out["tracker"] = {"config": tracker.config, "logged": tracker.logged, "finished": tracker.finished}
    out["bf16"] = bf16
    return out


@pytest.fixture(scope="module")
def api_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("api")
    (plain,) = run_distributed(_api_script, world_size=1, args=(False, str(folder / "plain")))
    (ours,) = run_distributed(_api_script, world_size=1, args=(True, str(folder / "ours")))
    return plain, ours


def _close(ours, theirs, tol=1e-5) -> bool:
    return len(ours) == len(theirs) and all(abs(a - b) <= tol * max(abs(b), 1e-3) for a, b in zip(ours, theirs))


def test_accumulate_syncs_steps_and_trains_as_plain_accelerate(api_runs):
    _compare_training(*api_runs)


def _compare_training(plain, ours):
    expected_sync = [False, True, False, True, True]  # 5 batches, k=2: the pass's last batch syncs
    for run in ("first", "second", "resumed"):
        a, b = ours[run], plain[run]
        assert a["sync"] == b["sync"] == expected_sync, (run, a["sync"], b["sync"])
        assert a["moved"] == b["moved"] == expected_sync, (run, a["moved"], b["moved"])  # no update in between
        assert a["skipped"] == b["skipped"] == [False] * 5
        assert _close(a["lr"], b["lr"], 1e-12), (run, a["lr"], b["lr"])
        assert _close(a["loss"], b["loss"]), (run, a["loss"], b["loss"])
    assert ours["step"] == plain["step"]
    assert ours["weights"].keys() == plain["weights"].keys()
    # over the whole model: AdamW turns a gradient that is 0 up to rounding (GPT-2's key bias) into +-lr steps
    difference = torch.cat([(ours["weights"][name] - t).flatten() for name, t in plain["weights"].items()])
    error = difference.norm() / torch.cat([t.flatten() for t in plain["weights"].values()]).norm()
    assert error <= 1e-5, float(error)


def test_clip_grad_norm_on_every_batch_is_plain_accelerates(api_runs):
    """The partial sums' norms (non-sync batches, clipped in place: the later losses agree only so) and
    the updates' norms, before clipping."""
    _compare_norms(*api_runs)


def _compare_norms(plain, ours):
    for run in ("first", "second", "resumed"):
        assert _close(ours[run]["norm"], plain[run]["norm"]), (run, ours[run]["norm"], plain[run]["norm"])
    assert max(plain["first"]["norm"]) > 1.0  # clipping did happen


def test_save_state_load_state_resumes_the_uninterrupted_pass(api_runs):
    plain, ours = api_runs
    for run in (ours, plain):
        for key in ("loss", "norm", "lr"):
            assert run["resumed"][key] == run["second"][key], (key, run["resumed"][key], run["second"][key])


def test_reduce_gather_and_gather_for_metrics_are_plain_accelerates(api_runs):
    plain, ours = api_runs
    for run in ("first", "second"):
        for reduction in ("sum", "mean", "max"):  # one process: the loss itself
            assert _close(ours[run][reduction], plain[run][reduction]), (run, reduction)
            assert ours[run][reduction] == ours[run]["loss"]
    assert ours["gather_0d"] == plain["gather_0d"] == ()
    assert ours["gather_dict"] == plain["gather_dict"] == {"a": "x"}
    assert ours["reduce_scaled"] == plain["reduce_scaled"] == 2.0
    assert ours["reduce_int"].dtype == plain["reduce_int"].dtype == torch.int64
    assert torch.equal(ours["eval"]["ids"], plain["eval"]["ids"]) and ours["eval"]["ids"].shape[0] == 5
    assert ours["eval"]["words"] == plain["eval"]["words"] and len(plain["eval"]["words"]) == 5
    assert _close(ours["eval"]["losses"], plain["eval"]["losses"])


def test_trackers_log_as_plain_accelerate(api_runs):
    plain, ours = api_runs
    a, b = ours["tracker"], plain["tracker"]
    assert a["config"] == b["config"] == {"lr": 1e-3, "accumulate": ACCUMULATE}
    assert a["finished"] and b["finished"]
    assert [step for step, _ in a["logged"]] == [step for step, _ in b["logged"]] == list(range(1, 6)) * 2
    assert _close([v["loss"] for _, v in a["logged"]], [v["loss"] for _, v in b["logged"]])


def test_autocast_is_nothing_at_fp32(api_runs):
    plain, ours = api_runs
    assert ours["autocast"] == plain["autocast"] == (False, torch.float32)


def _bf16_part(megatron: bool, world: int, folder: str, tp: int, pp: int) -> dict:
    from torch.utils.data import DataLoader

    from tiny import tiny_hf_model
    Accelerator = _accelerate_class(megatron, world, tp, pp)
    accelerator = Accelerator(mixed_precision="bf16")
    model = tiny_hf_model("gpt2")
    data = [{"input_ids": b, "labels": b} for b in _blocks(4, model.config.vocab_size, seed=5)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=2))
    with accelerator.autocast():
        out = {"flags": (torch.is_autocast_enabled("cpu"), (torch.ones(2, 2) @ torch.ones(2, 2)).dtype)}
    batch = next(iter(loader))
    model.eval()
    with torch.no_grad():
        out["eval"] = [model(**batch).loss.item()]
        with accelerator.autocast():
            out["eval"].append(model(**batch).loss.item())
    model.train()
    accelerator.save_state(folder)
    for inside in (False, True):  # the same two updates from the same state, outside and inside autocast
        accelerator.load_state(folder)
        out[inside] = []
        for batch in loader:
            with accelerator.autocast() if inside else contextlib.nullcontext():
                loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            out[inside].append(loss.item())
    return out


def test_autocast_at_bf16_is_plain_accelerates(api_runs):
    plain, ours = (run["bf16"] for run in api_runs)
    assert ours["flags"] == plain["flags"] == (True, torch.bfloat16)
    for run in (ours, plain):
        assert run["eval"][0] == run["eval"][1], run["eval"]
        assert run[True] == run[False], (run[True], run[False])


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_model_parallel_accumulation_and_clipping_are_plain_accelerates(api_runs, tmp_path, tp, pp):
    """tp 2 (sequence parallel: the norm sums the layer norms' partial gradients over tp) and pp 2 (GPT-2's
    tied embedding: its two stages' partial gradients summed) against plain accelerate's one process."""
    plain, _ = api_runs
    ours = run_distributed(_api_script, world_size=tp * pp, args=(True, str(tmp_path / "ours"), tp, pp))[-1]
    _compare_training(plain, ours)
    _compare_norms(plain, ours)


def _dp2_script(rank, world, megatron: bool) -> dict:
    from torch.utils.data import DataLoader
    from transformers import get_linear_schedule_with_warmup

    from tiny import tiny_hf_model
    Accelerator = _accelerate_class(megatron, world)
    accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATE)
    model = tiny_hf_model("gpt2")
    data = [{"input_ids": b, "labels": b} for b in _blocks(10, model.config.vocab_size, seed=5)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = get_linear_schedule_with_warmup(optimizer, 0, 4)
    # 10 samples, batches of 2 over 2 processes: 3 batches each, the last one evened out with duplicates
    model, optimizer, loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, DataLoader(data, batch_size=2), DataLoader(data[:5], batch_size=2), scheduler)
    out = {"train": _train_pass(accelerator, model, optimizer, loader, scheduler, log=False),
           "eval": _evaluate(accelerator, model, eval_loader)}
    out.update(gather_0d=accelerator.gather(torch.tensor(float(rank))),
               reduce_rank=accelerator.reduce(torch.tensor([float(rank), 1.0]), "max"))
    return out


@pytest.mark.slow
def test_dp2_metrics_and_accumulation_are_plain_accelerates():
    plain = run_distributed(_dp2_script, world_size=2, args=(False,))
    ours = run_distributed(_dp2_script, world_size=2, args=(True,))
    for a, b in zip(ours, plain):
        assert torch.equal(a["eval"]["ids"], b["eval"]["ids"]) and a["eval"]["ids"].shape[0] == 5  # duplicates dropped
        assert a["eval"]["words"] == b["eval"]["words"] and len(a["eval"]["words"]) == 5
        assert torch.equal(a["gather_0d"], b["gather_0d"]) and a["gather_0d"].tolist() == [0.0, 1.0]
        assert torch.equal(a["reduce_rank"], b["reduce_rank"])
        a, b = a["train"], b["train"]
        assert a["sync"] == b["sync"] == a["moved"] == b["moved"] == [False, True, True], (a, b)
        assert _close(a["lr"], b["lr"], 1e-12), (a["lr"], b["lr"])
        # our loss is the data-parallel mean already (README); reduced, it is plain accelerate's
        for reduction in ("sum", "mean"):
            assert _close(a[reduction], b[reduction]), (reduction, a[reduction], b[reduction])
        # each process's own partial sum on the batch that only accumulates (clipped), then the update's
        assert _close(a["norm"], b["norm"]), (a["norm"], b["norm"])

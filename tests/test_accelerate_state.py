"""The Accelerator's Megatron-LM path in-process on gloo workers (no `accelerate launch`):
save_state / load_state round trips, eval of any batch size, return_logits, gather_for_metrics over
the data-parallel group, and the one-line errors."""
from __future__ import annotations

import os

import pytest
import torch

from dist import run_distributed
from tiny import rel_err

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


def _eval_outputs(accelerator, model):
    """Eval of a 5-sample batch (not a multiple of the micro batches) with and without logits."""
    model.eval()
    batch = {"input_ids": _blocks(5, model.config.vocab_size, seed=9)}
    batch["labels"] = batch["input_ids"]
    plain = model(**batch)
    accelerator.state.megatron_lm_plugin.return_logits = True
    with_logits = model(**batch)
    accelerator.state.megatron_lm_plugin.return_logits = False
    return {"loss": plain.loss.item(), "logits_loss": with_logits.loss.item(), "logits": with_logits.logits,
            "hf": accelerator.unwrap_model(model), "batch": batch}


def _round_trip(rank, world, tp, pp, folder):
    accelerator, (model, optimizer, loader, scheduler) = _setup(tp, pp)
    evals = _eval_outputs(accelerator, model)
    hf = evals.pop("hf")
    with torch.no_grad():
        reference = hf(**evals.pop("batch"))
    evals.update(hf_loss=reference.loss.item(), hf_logits=reference.logits)
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
    return {"evals": evals, "first": first, "after": after, "again": again, "weights": weights,
            "weights_again": accelerator.get_state_dict(model), "lr": lr, "lr_again": scheduler.get_last_lr()}


@pytest.mark.parametrize("tp,pp", [pytest.param(2, 2, marks=pytest.mark.slow), (1, 2)])
def test_save_state_load_state_continue_exactly(tmp_path, tp, pp):
    results = run_distributed(_round_trip, world_size=tp * pp, args=(tp, pp, str(tmp_path / "state")))
    main = results[-1]  # accelerate's Megatron-LM main process: the last rank
    assert main["after"] == main["again"], main
    assert main["lr"] == main["lr_again"]
    assert main["weights"].keys() == main["weights_again"].keys() and main["weights"]
    for name, tensor in main["weights"].items():
        assert torch.equal(tensor, main["weights_again"][name]), name
    assert all(r["weights"] == {} for r in results[:-1])  # get_state_dict: the main process only
    # eval: any batch size, loss and full-vocabulary logits on every rank, as transformers gives them
    for r in results:
        e = r["evals"]
        assert abs(e["loss"] - e["hf_loss"]) <= 1e-5 * e["hf_loss"], e
        assert abs(e["logits_loss"] - e["hf_loss"]) <= 1e-5 * e["hf_loss"], e
        assert e["logits"].shape == e["hf_logits"].shape
        assert rel_err(e["logits"], e["hf_logits"]) <= 1e-5


def _gather_dp(rank, world):
    from torch.utils.data import DataLoader

    from hf_megatron import Accelerator
    from tiny import tiny_hf_model
    _env(1, 1)
    _reset_accelerate()
    accelerator = Accelerator()
    model = tiny_hf_model("llama")
    samples = [{"input_ids": b} for b in _blocks(5, model.config.vocab_size, seed=4)]
    model, loader = accelerator.prepare(model, DataLoader(samples, batch_size=1))  # 2 x 1 per dp rank
    gathered = []
    for batch in loader:
        gathered.append(accelerator.gather_for_metrics(batch["input_ids"]))
    plugin = accelerator.state.megatron_lm_plugin
    return {"gathered": torch.cat(gathered), "expected": torch.stack([s["input_ids"] for s in samples]),
            "batches": len(loader), "global_batch_size": plugin.global_batch_size,
            "micro_batch_size": plugin.micro_batch_size, "distributed_type": str(accelerator.distributed_type),
            "main": accelerator.is_main_process, "num_processes": accelerator.num_processes}


def _gather_and_errors(rank, world):
    return _gather_dp(rank, world), _errors(rank, world)


def test_gather_for_metrics_over_dp_and_one_line_errors():
    """dp2: gather_for_metrics drops even_batches' duplicates; then every unsupported use fails
    in one line naming the API (one spawn for both: it is the expensive part)."""
    results = run_distributed(_gather_and_errors, world_size=2)
    for rank, (r, messages) in enumerate(results):
        _check_errors(messages)
        assert torch.equal(r["gathered"], r["expected"])  # 5 samples, not 6 or 8
        assert r["batches"] == 2 and r["micro_batch_size"] == 1 and r["global_batch_size"] == 4
        assert r["distributed_type"] == "DistributedType.MEGATRON_LM" and r["num_processes"] == 2
        assert r["main"] == (rank == 1)  # accelerate: the last rank under Megatron-LM


def _errors(rank, world):
    from accelerate.utils import MegatronLMPlugin
    from torch.utils.data import DataLoader

    from hf_megatron import Accelerator
    from hf_megatron.errors import ConfigError
    from tiny import tiny_hf_model
    _env(1, 1)
    messages = {}

    def expect(key, fn):
        try:
            fn()
        except ConfigError as exc:
            messages[key] = str(exc)
        else:
            messages[key] = None

    _reset_accelerate()
    expect("custom_train_step", lambda: Accelerator(megatron_lm_plugin=MegatronLMPlugin(custom_train_step_class=object)))
    _reset_accelerate()
    accelerator = Accelerator()
    hf = tiny_hf_model("gpt2")
    expect("sgd", lambda: accelerator.prepare(torch.optim.SGD(hf.parameters(), lr=0.1)))
    model = accelerator.prepare(hf)
    expect("train_without_optimizer", lambda: model(input_ids=_blocks(2, 300)))
    expect("unknown_input", lambda: model.eval()(input_ids=_blocks(2, 300), token_type_ids=_blocks(2, 300)))
    expect("second_model", lambda: accelerator.prepare(tiny_hf_model("gpt2")))
    expect("clip", lambda: accelerator.clip_grad_norm_(model.parameters(), 0.5))
    expect("clip_value", lambda: accelerator.clip_grad_value_(model.parameters(), 0.5))
    expect("no_sync", lambda: accelerator.no_sync(model).__enter__())  # a script's own accumulation
    half = [p for n, p in hf.named_parameters() if "c_attn" not in n]
    expect("missing_params", lambda: accelerator.prepare(torch.optim.AdamW(half, lr=1e-3)))
    expect("loader_without_batch_size",
           lambda: accelerator.prepare(DataLoader(list(range(4)), batch_sampler=[[0, 1], [2, 3]])))

    from accelerate.utils import DataLoaderConfiguration
    _reset_accelerate()
    dispatching = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    expect("dispatch_batches", lambda: dispatching.prepare(DataLoader(list(range(4)), batch_size=2)))

    # any order, several calls: scheduler, then optimizer, then the model they belong to
    from accelerate.utils import MegatronLMDummyScheduler
    _reset_accelerate()
    accelerator = Accelerator()
    hf = tiny_hf_model("llama")
    groups = [{"params": [p for n, p in hf.named_parameters() if "norm" not in n], "weight_decay": 0.1},
              {"params": [p for n, p in hf.named_parameters() if "norm" in n], "weight_decay": 0.0, "lr": 5e-4}]
    user_optimizer = torch.optim.AdamW(groups, lr=1e-3)
    scheduler = accelerator.prepare(MegatronLMDummyScheduler(user_optimizer, total_num_steps=20, warmup_num_steps=4))
    optimizer = accelerator.prepare(user_optimizer)
    accelerator.prepare(hf)
    messages["order"] = {"weight_decay": [g["weight_decay"] for g in optimizer.param_groups],
                         "lr_mult": [g["lr_mult"] for g in optimizer.param_groups],
                         "warmup_lr": scheduler.get_last_lr(), "bound": accelerator._engine.scheduler is not None}
    return messages


def _check_errors(messages):
    order = messages.pop("order")
    assert order["bound"] and order["weight_decay"] == [0.1, 0.0] and order["lr_mult"] == [1.0, 0.5], order
    assert order["warmup_lr"] == [0.0, 0.0], order  # Megatron's warmup starts at 0
    expected = {"custom_train_step": "MegatronLMPlugin.custom_train_step_class", "sgd": "SGD",
                "train_without_optimizer": "no optimizer", "unknown_input": "token_type_ids",
                "second_model": "second model", "clip": "clip_grad_norm_", "missing_params": "c_attn",
                "clip_value": "megatron_lm_gradient_clipping", "dispatch_batches": "dispatch_batches=True",
                "no_sync": "accelerator.accumulate(model)",
                "loader_without_batch_size": "batch_size"}
    for key, needle in expected.items():
        assert messages[key] is not None, f"{key}: no error"
        assert needle in messages[key] and "\n" not in messages[key], (key, messages[key])


def _dynamo(rank, world):
    """Two steps with Accelerator(dynamo_backend="aot_eager") and two without, from the same weights."""
    from hf_megatron.parallel import state
    from hf_megatron.parallel.compile import compile_scope
    out = {}
    for backend in (None, "aot_eager"):
        os.environ.pop("ACCELERATE_DYNAMO_BACKEND", None)
        if backend:
            os.environ["ACCELERATE_DYNAMO_BACKEND"] = backend.upper()  # what `accelerate launch --dynamo_backend` sets
        try:
            accelerator, (model, _, loader, _) = _setup(1, 1, shuffle=False)
            out[backend] = {"losses": _train(model, iter(loader), 2), "scope": compile_scope(model.chunks[0])}
        finally:
            os.environ.pop("ACCELERATE_DYNAMO_BACKEND", None)
            state.reset()
    return out


def test_accelerate_dynamo_backend_compiles_each_layer():
    """accelerate compiles the prepared model when a dynamo backend is set (and only then); under
    Megatron-LM the backend compiles each layer of our model, with the eager losses."""
    out = run_distributed(_dynamo, world_size=1, args=())[0]
    assert out[None]["scope"] is None and out["aot_eager"]["scope"] == "layer"
    for a, b in zip(out["aot_eager"]["losses"], out[None]["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b)

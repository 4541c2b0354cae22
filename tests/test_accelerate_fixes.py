"""The Accelerator's Megatron-LM path where a new user's script expects plain accelerate / torch
behaviour (in-process gloo workers, tiny models): a load_state_dict into the prepared bf16 model is
what the next step updates; `unwrap_model(model).save_pretrained(dir, state_dict=get_state_dict(model))`
on every rank leaves the main process's weights (the other ranks' {} writes nothing); a short last
batch at dp 1 stays short; bf16 weights read back are the fp32 main weights; eval without labels gives loss=None; bad plugin numbers are one line;
split_batches splits the loader's batch over dp."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist import run_distributed
from test_accelerate_state import _blocks, _env, _reset_accelerate


def _prepared(tp: int, mixed_precision: str = "no", batch_size: int = 2, samples: int = 8, **accelerator_kwargs):
    from torch.utils.data import DataLoader

    from hf_megatron import Accelerator
    from tiny import tiny_hf_model
    _env(tp, 1, num_micro=1)
    _reset_accelerate()
    accelerator = Accelerator(mixed_precision=mixed_precision, **accelerator_kwargs)
    model = tiny_hf_model("llama")
    data = [{"input_ids": b, "labels": b} for b in _blocks(samples, model.config.vocab_size, seed=5)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    return accelerator, accelerator.prepare(model, optimizer, DataLoader(data, batch_size=batch_size))


def _load_then_step(rank, world):
    accelerator, (model, optimizer, loader) = _prepared(world, "bf16")
    batches = list(loader)
    model.train()
    model(**batches[0])
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    model(**batches[1])
    model.load_state_dict(snapshot)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    model(**batches[2])  # at lr 0 the loaded weights stay as loaded (plain torch)
    return {k: torch.equal(v, snapshot[k]) for k, v in model.state_dict().items()}


def test_bf16_load_state_dict_is_what_the_next_step_updates():
    for kept in run_distributed(_load_then_step, world_size=1):
        assert kept and all(kept.values()), kept


def _save_pretrained_every_rank(rank, world, folder):
    from transformers import AutoModelForCausalLM
    accelerator, (model, _, _) = _prepared(world)
    state_dict = accelerator.get_state_dict(model)
    unwrapped = accelerator.unwrap_model(model)
    for writer in (True, False):  # the main process first: the others' {} must not undo its save
        if accelerator.is_main_process == writer:
            unwrapped.save_pretrained(folder, state_dict=state_dict)
        dist.barrier()
    reloaded = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    return all(torch.equal(reloaded[k], v) for k, v in unwrapped.state_dict().items())


def test_save_pretrained_of_get_state_dict_on_every_rank_keeps_the_main_process_save(tmp_path):
    assert run_distributed(_save_pretrained_every_rank, world_size=2, args=(str(tmp_path / "hf"),)) == [True, True]


def _short_last_batch(rank, world):
    accelerator, (model, _, loader) = _prepared(world, samples=5)
    model.train()
    sizes, seen = [], []
    for batch in loader:
        sizes.append(len(batch["input_ids"]))
        seen.append(accelerator.gather_for_metrics(batch["input_ids"]))
        model(**batch)
    return {"sizes": sizes, "len": len(loader), "seen": torch.cat(seen), "expected": loader.dataset}


def test_dp1_short_last_batch_is_not_padded():
    """At dp 1 (tp 2 here) plain accelerate's one process yields [2, 2, 1], not sample 0 again."""
    for r in run_distributed(_short_last_batch, world_size=2):
        assert r["sizes"] == [2, 2, 1] and r["len"] == 3, r
        assert torch.equal(r["seen"], torch.stack([s["input_ids"] for s in r["expected"]]))


def _bf16_weights(rank, world, tp, distributed):
    import json
    import os

    from safetensors.torch import load_file

    from hf_megatron.integrations.accelerate.weights import gather_full, hf_state_dict
    os.environ["MEGATRON_LM_USE_DISTRIBUTED_OPTIMIZER"] = str(distributed).lower()
    accelerator, (model, _, loader) = _prepared(tp, "bf16")
    model.train()
    for batch in loader:
        model(**batch)
    state_dict = accelerator.get_state_dict(model)
    unwrapped = accelerator.unwrap_model(model).state_dict()
    accelerator.save_model(model, folder := f"{os.environ['TEST_FOLDER']}/saved")
    chunks = list(model.chunks)
    bf16 = gather_full(chunks, dst=None)  # the model's own (bf16) weights
    bf16 = hf_state_dict(bf16, chunks[0].config)
    if not accelerator.is_main_process:
        return None
    saved = load_file(f"{folder}/model.safetensors")
    return {"dtypes": {str(t.dtype) for d in (state_dict, unwrapped, saved) for t in d.values()},
            "config_dtype": json.load(open(f"{folder}/config.json")).get("dtype"),
            "rounds_to_model": all(torch.equal(state_dict[k].bfloat16(), bf16[k]) for k in state_dict),
            "finer_than_bf16": any(not torch.equal(v.bfloat16().float(), v) for v in state_dict.values()),
            "same": all(torch.equal(state_dict[k], unwrapped[k]) for k in state_dict)
            and all(torch.equal(state_dict[k], saved[k]) for k in saved)}


@pytest.mark.parametrize("tp,distributed", [(2, False), (1, True)])
def test_bf16_weights_are_the_fp32_main_weights(tmp_path, monkeypatch, tp, distributed):
    """Plain accelerate's bf16 (autocast over fp32 params) saves fp32: get_state_dict, unwrap_model and
    save_model give the optimizer's fp32 main weights (tp 2 gathered; dp 2 with the distributed optimizer,
    whose shards are assembled), config.json says float32."""
    monkeypatch.setenv("TEST_FOLDER", str(tmp_path))
    main = run_distributed(_bf16_weights, world_size=2, args=(tp, distributed))[-1]
    assert main == {"dtypes": {"torch.float32"}, "config_dtype": "float32", "rounds_to_model": True,
                    "finer_than_bf16": True, "same": True}, main


def _eval_without_labels(rank, world):
    accelerator, (model, _, loader) = _prepared(world)
    model.eval()
    batch = next(iter(loader))
    unlabelled = model(input_ids=batch["input_ids"])
    labelled = model(**batch)
    return {"loss": unlabelled.loss, "logits": None if unlabelled.logits is None else tuple(unlabelled.logits.shape),
            "labelled_loss": labelled.loss is not None}


def test_eval_without_labels_gives_no_loss_as_transformers():
    for r in run_distributed(_eval_without_labels, world_size=2):
        assert r["loss"] is None and r["labelled_loss"] and r["logits"][:2] == (2, 16), r


def test_bad_plugin_numbers_are_one_line_errors(monkeypatch):
    """megatron_lm_num_micro_batches: 0 (accelerate would train as 1 and report global_batch_size 0) and
    megatron_lm_tp_degree: two (accelerate's int() traceback) name the accelerate config field."""
    from accelerate.utils import MegatronLMPlugin

    import hf_megatron.integrations.accelerate  # noqa: F401 -- guards MegatronLMPlugin
    from hf_megatron.errors import ConfigError
    from hf_megatron.integrations.accelerate.plugin import training_config_from_plugin
    for value in ("0", "-2"):
        monkeypatch.setenv("MEGATRON_LM_NUM_MICRO_BATCHES", value)
        with pytest.raises(ConfigError, match=f"megatron_lm_num_micro_batches={value}: expected a positive"):
            training_config_from_plugin(MegatronLMPlugin(), "no")
    monkeypatch.setenv("MEGATRON_LM_NUM_MICRO_BATCHES", "1")
    monkeypatch.setenv("MEGATRON_LM_TP_DEGREE", "two")
    with pytest.raises(ConfigError, match="megatron_lm_tp_degree='two': expected an integer"):
        MegatronLMPlugin()


def _split_batches(rank, world):
    from accelerate.utils import DataLoaderConfiguration

    from hf_megatron.errors import ConfigError
    accelerator, (model, _, loader) = _prepared(1, batch_size=4, samples=8,
                                                dataloader_config=DataLoaderConfiguration(split_batches=True))
    sizes, seen = [len(batch["input_ids"]) for batch in loader], []
    for batch in loader:
        seen.append(accelerator.gather_for_metrics(batch["input_ids"]))
    try:
        accelerator._micro_batch_of(3)
        error = None
    except ConfigError as exc:
        error = str(exc)
    return {"len": len(loader), "sizes": sizes, "all": torch.equal(torch.cat(seen), torch.stack(
        [s["input_ids"] for s in loader.dataset])), "error": error}


def test_split_batches_splits_the_loader_batch_over_dp():
    """Plain accelerate's split_batches at 2 processes: batch_size 4 is the batch across them (2 each),
    len(dl) = 8 / 4; a batch_size dp does not divide is a one-line error."""
    for r in run_distributed(_split_batches, world_size=2):
        assert r["len"] == 2 and r["sizes"] == [2, 2] and r["all"], r
        assert "batch_size=3 is split over the 2 data-parallel ranks" in r["error"], r

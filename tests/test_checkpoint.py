"""Megatron-layout checkpoints: files and fields, exact resume (model, optimizer, scheduler, RNG),
atomic writes, clear errors on a layout mismatch."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import hf_megatron
from hf_megatron.conversion.convert import hf_to_megatron
from hf_megatron.conversion.hf_io import CheckpointError
from hf_megatron.checkpoint.checksums import sidecar
from hf_megatron.checkpoint.unpickle import safe_load
from hf_megatron.parallel import state
from hf_megatron.parallel.random import model_parallel_seed
from hf_megatron.training.checkpoint import checkpoint_info, load_checkpoint, save_checkpoint
from test_convert_helpers import hf_sources  # noqa: F401
from tiny import VOCAB, tiny_hf_model


def _train(model, optimizer, scheduler, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, 12), generator=gen)
        optimizer.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses


def _setup(seed=0):
    model = hf_megatron.from_pretrained(tiny_hf_model("gpt2", seed=seed, resid_pdrop=0.1, attn_pdrop=0.1)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def test_save_writes_megatron_layout_and_resume_is_exact(tmp_path):
    state.reset()
    model_parallel_seed(3)  # dropout is on: resuming must restore the RNG streams too
    model, optimizer, scheduler = _setup()
    uninterrupted = _train(model, optimizer, scheduler, 3, seed=1) + _train(model, optimizer, scheduler, 3, seed=2)

    model_parallel_seed(3)
    model, optimizer, scheduler = _setup()
    first_half = _train(model, optimizer, scheduler, 3, seed=1)
    save_checkpoint(tmp_path, 3, model, optimizer, scheduler, extra={"consumed_train_samples": 6})
    after_save = (torch.rand(3), np.random.rand(), random.random())
    assert first_half == uninterrupted[:3]

    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "3"
    payload = safe_load(tmp_path / "iter_0000003/mp_rank_00/model_optim_rng.pt")
    assert {"model", "optimizer", "opt_param_scheduler", "rng_state", "args", "iteration",
            "checkpoint_version"} <= set(payload)
    assert payload["checkpoint_version"] == 3.0 and payload["iteration"] == 3
    args = payload["args"]
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.padded_vocab_size) == (2, 64, 4, 384)
    assert args.normalization == "LayerNorm" and args.position_embedding_type == "learned_absolute"
    assert not args.untie_embeddings_and_output_weights and args.add_bias_linear and not args.swiglu
    assert checkpoint_info(tmp_path)["consumed_train_samples"] == 6

    # a fresh run (other weights, other seed, fresh optimizer) resumed from the checkpoint
    model_parallel_seed(99)
    model2, optimizer2, scheduler2 = _setup(seed=5)
    assert load_checkpoint(tmp_path, model2, optimizer2, scheduler2) == 3
    resumed_rng = (torch.rand(3), np.random.rand(), random.random())
    assert torch.equal(resumed_rng[0], after_save[0]) and resumed_rng[1:] == after_save[1:]
    load_checkpoint(tmp_path, model2, optimizer2, scheduler2)
    assert _train(model2, optimizer2, scheduler2, 3, seed=2) == uninterrupted[3:]


def test_interrupted_save_keeps_previous_checkpoint(tmp_path):
    state.reset()
    model, optimizer, scheduler = _setup()
    save_checkpoint(tmp_path, 1, model, optimizer, scheduler)

    class Broken:
        def state_dict(self):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(tmp_path, 2, model, optimizer, Broken())
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert not (tmp_path / "iter_0000002").exists()
    assert load_checkpoint(tmp_path, model, optimizer, scheduler) == 1


def test_load_with_other_tp_is_a_clear_error(hf_sources, tmp_path):
    state.reset()
    hf_to_megatron(hf_sources["llama"], tmp_path / "tp2", tp=2)
    model = hf_megatron.from_pretrained(hf_sources["llama"])
    with pytest.raises(CheckpointError, match=r"saved with tp=2, pp=1 but this run has tp=1.*reshard"):
        load_checkpoint(tmp_path / "tp2", model)
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        hf_to_megatron(hf_sources["llama"], tmp_path / "tp1")
        load_checkpoint(tmp_path / "tp1", model, torch.optim.AdamW(model.parameters()))


def test_load_megatron_lm_file_with_numpy_rng_and_cuda_tracker(tmp_path):
    """A file as Megatron-LM writes it: numpy RNG array, CUDA tracker streams, scheduler dict."""
    state.reset()
    model, _, _ = _setup()
    save_checkpoint(tmp_path, 5, model)
    path = tmp_path / "iter_0000005/mp_rank_00/model_optim_rng.pt"
    payload = safe_load(path)
    payload["rng_state"] = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.ones(8, dtype=torch.uint8),
                             "rng_tracker_states": {"model-parallel-rng": torch.ones(8, dtype=torch.uint8)}}]
    torch.save(payload, path)
    sidecar(path).unlink()  # Megatron-LM writes no checksum sidecar
    fresh, _, _ = _setup(seed=3)
    assert load_checkpoint(tmp_path, fresh) == 5
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name

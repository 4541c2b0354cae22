"""Activation recompute ("full": whole layers, "selective": the attention core) changes memory,
not numerics: training losses and weights equal the no-recompute run -- with dropout on, so the
recomputation must replay the same dropout masks -- and fewer activation bytes are saved.

Memory is measured without CUDA: every tensor autograd saves for backward passes through
`torch.autograd.graph.saved_tensors_hooks`; we sum the bytes of the distinct storages (views
of one storage counted once, parameters excluded).  Under full recompute the checkpointed
layers save nothing through our hook (torch's checkpoint keeps only each layer's input, which
we add: s x b x h x 4 bytes per layer).
"""
import importlib.util
from pathlib import Path

import pytest
import torch

from hf_megatron.config import ModelConfig
from hf_megatron.loading import build_model
from tiny import rel_err
from training_helpers import make_batches, our_run

# the measurement is the benchmark's own (bench/recompute_memory.py), so test and bench agree by construction
_BENCH = Path(__file__).resolve().parents[1] / "bench" / "recompute_memory.py"
_spec = importlib.util.spec_from_file_location("recompute_memory", _BENCH)
_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_bench)
saved_bytes = _bench.saved_bytes

DROPOUT = {"llama": dict(attention_dropout=0.1),
           "gpt2": dict(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)}


def _run(arch, recompute):
    return our_run(arch, {}, make_batches(3), hf_overrides=DROPOUT[arch], recompute_granularity=recompute)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_recompute_gives_identical_losses_and_weights(arch):
    base = _run(arch, None)
    for mode in ("selective", "full"):
        other = _run(arch, mode)
        # same ops, same inputs, same RNG streams (observed: bit-identical on CPU)
        for a, b in zip(other["losses"], base["losses"]):
            assert abs(a - b) <= 1e-6 * b, (mode, other["losses"], base["losses"])
        for name, weight in base["state"].items():
            assert rel_err(other["state"][name], weight) <= 1e-5, (mode, name)
    # dropout really is on (otherwise the mask replay would be untested)
    assert base["config"].attention_dropout == 0.1


def test_recompute_saves_fewer_activation_bytes():
    b, s, h, heads, layers = 2, 128, 128, 4, 2
    config = ModelConfig(model_type="llama", vocab_size=1000, hidden_size=h, num_layers=layers,
                         num_attention_heads=heads, ffn_hidden_size=3 * h, attention_dropout=0.1)
    ids = torch.randint(0, 1000, (b, s), generator=torch.Generator().manual_seed(0))
    saved = {}
    for mode in (None, "selective", "full"):
        model = build_model(config, recompute=mode, seed=0)
        model.train()
        saved[mode] = saved_bytes(model, ids)
    saved["full"] += layers * s * b * h * 4  # the checkpointed layer inputs
    probs = b * heads * s * s * 4  # one layer's fp32 attention probabilities
    assert saved["selective"] <= saved[None] - layers * probs  # no attention-core activations kept
    assert saved["full"] < 0.4 * saved[None]

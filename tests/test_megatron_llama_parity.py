"""Llama's RoPE in the megatron-core 0.16.1 GPTModel that Megatron-LM (core_v0.16.1) builds from our
checkpoint's args.

Megatron-LM's gpt_builders.py passes GPTModel `rope_scaling=args.use_rope_scaling` and no factor or
context, so megatron-core's RotaryEmbedding._apply_scaling always applies Llama 3.1's llama3 scheme
(factor 8, low / high frequency factors 1 / 4, original context 8192).  Only a Llama with exactly
those constants gets its own RoPE back from our args:

* Llama 3.1's constants: megatron-core's GPTModel, configured from our rank file's args alone
  (`mcore_model_from_args`: Megatron-LM's rule) and loaded strictly, gives transformers' logits
  (measured 2e-7) and transformers' inverse frequencies; writing the args warns about nothing.
* tests/tiny.py's llama (llama3 with original context 16), Llama 3.2's factor 32 and linear
  scaling: writing the args warns in one line naming the field, and what it says is true --
  megatron-core's inverse frequencies are not transformers' (the tiny llama's logits differ by
  6e-3, its loss by 1.2e-5: the 9.4e-6 first-step loss difference megatron-core's distributed
  optimizer run once showed in tests/test_megatron_distrib_optim.py).
"""
from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from dist import run_distributed
from hf_megatron.checkpoint.unpickle import safe_load
from hf_megatron.conversion.convert import hf_to_megatron
from test_convert_helpers import save_hf
from tiny import rel_err

# a tiny Llama with what Megatron-LM's --use-rope-scaling computes (transformers wants a longer context
# than the original one, as Llama 3.1's 131072 > 8192)
LLAMA31 = {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}, "max_position_embeddings": 16384}
# name: (overrides of tests/tiny.py's llama; what the warning names, None = no warning)
CASES = {
    "llama3.1": (LLAMA31, None),
    "tiny": ({}, "llama3 original_max_position_embeddings 16"),
    "llama3.2": ({**LLAMA31, "rope_scaling": {**LLAMA31["rope_scaling"], "factor": 32.0}}, "llama3 factor 32.0"),
    "linear": ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type 'linear'"),
}
IDS = torch.tensor([[3, 17, 250, 9, 41, 128, 77, 5, 299, 0, 64, 12, 200, 33, 150, 7, 90, 260, 1, 45]])


def _megatron_core_logits(rank, world, files):
    """{name: (logits, inverse frequencies)} of megatron-core's GPTModel built from each rank file's args."""
    from megatron.core import parallel_state, tensor_parallel
    from test_megatron_interop import mcore_model_from_args
    parallel_state.initialize_model_parallel(1, 1)
    torch.cuda.current_device = lambda: "cpu"  # RoPE tables (no dropout: nothing forks the CUDA RNG)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    out = {}
    for name, path in files.items():
        payload = safe_load(path)
        model = mcore_model_from_args(payload["args"]).eval()
        loaded = model.load_state_dict(payload["model"], strict=False)
        assert not loaded.unexpected_keys and all(k.endswith("_extra_state") for k in loaded.missing_keys)
        with torch.no_grad():
            seq = IDS.shape[1]  # the causal mask as Megatron-LM builds it (True = masked)
            causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
            logits = model(IDS, position_ids=torch.arange(seq)[None], attention_mask=causal)
            out[name] = (logits, model.rotary_pos_emb.inv_freq.clone())
    parallel_state.destroy_model_parallel()
    return out


def test_megatron_lm_builds_llama_rope_from_our_args_or_we_warn(tmp_path):
    files = {}
    for name, (overrides, warned) in CASES.items():
        src = save_hf(tmp_path / name, "llama", **overrides)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hf_to_megatron(src, tmp_path / f"{name}_megatron")
        ours = [str(w.message) for w in caught if "rope_scaling" in str(w.message)]
        assert len(ours) == (warned is not None), (name, ours)
        if warned:
            assert len(ours[0].splitlines()) == 1 and f"rope_scaling {warned}" in ours[0] and "8192" in ours[0], name
        files[name] = str(tmp_path / f"{name}_megatron/release/mp_rank_00/model_optim_rng.pt")
    theirs = run_distributed(_megatron_core_logits, 1, (files,))[0]
    measured = {}
    for name, (_, warned) in CASES.items():
        reference = AutoModelForCausalLM.from_pretrained(tmp_path / name, local_files_only=True).eval()
        with torch.no_grad():
            expected = reference(IDS).logits
        logits, inv_freq = theirs[name]
        hf_inv_freq = reference.model.rotary_emb.inv_freq.float()
        measured[name] = (((inv_freq - hf_inv_freq).abs() / hf_inv_freq).max().item(),  # the worst frequency
                          rel_err(logits[..., :expected.shape[-1]], expected))
    print("megatron-core vs transformers (inverse frequencies, logits):", measured)
    for name, (_, warned) in CASES.items():
        if warned is None:  # Megatron-LM's own scheme: the same model
            assert measured[name][0] <= 1e-6 and measured[name][1] <= 1e-5, name
        else:  # what the warning says: other RoPE frequencies
            assert measured[name][0] > 1e-2, name
    assert measured["tiny"][1] > 1e-4  # positions up to 20 > the tiny llama's original context 16

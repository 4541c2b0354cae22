"""Qwen3 (per-head q/k RMSNorm, head_dim 32 != hidden / heads = 16) against transformers.

The tiny model's q/k norm weights are random (tiny.py), so a mapping or ordering error shows:
(a) one process: logits, loss and every gradient equal transformers (fp32, rel <= 1e-5), also
    with attention biases and with a sliding window on every layer;
(b) tp=2 (with and without sequence parallelism) and pp=2 (1F1B, interleaved) on gloo: the same
    against the single-process transformers model -- the q/k norm gradients are partial per TP
    rank (its own heads) and come right only through the tag `parallelize` puts on them;
(c) `hf-megatron convert` HF -> Megatron (tp2 x pp2) -> HF is bit-identical, --verify passes;
(d) megatron-core's GPTModel (local spec, qk_layernorm=True, tp=2) loads our rank files
    strictly and gives transformers' logits.
"""
from __future__ import annotations

import contextlib
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_megatron
from dist import run_distributed
from hf_megatron import ConfigError, ModelConfig, architectures
from hf_megatron.conversion.convert import hf_to_megatron
from hf_megatron.checkpoint.args import build_args
from test_convert_dist import _mcore_model
from test_convert_helpers import cli_round_trip, save_hf
from test_pipeline import check_case, pipeline_worker
from test_tensor_parallel import _batch
from tiny import VOCAB, hf_grads_from_mcore, local_grads, merge_shards, rel_err, tiny_config, tiny_hf_model

TOL = 1e-5
VARIANTS = {"default": {}, "attention-bias": dict(attention_bias=True),
            "sliding-every-layer": dict(use_sliding_window=True, sliding_window=8, max_window_layers=0)}
PP2_CASES = [("qwen3", 1, None, {}), ("qwen3", 2, None, {"recompute": "selective"})]  # 1F1B; interleaved


@pytest.fixture(scope="module")
def qwen3_source(tmp_path_factory):
    return save_hf(tmp_path_factory.mktemp("qwen3") / "hf", "qwen3")


def _hf_reference(**overrides):
    hf = tiny_hf_model("qwen3", **overrides)
    ids, labels = _batch()
    out = hf(input_ids=ids, labels=labels)
    out.loss.backward()
    return out, {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}, ModelConfig.from_hf(hf.config)


def _assert_matches_transformers(logits, loss, full_grads, overrides=None):
    """Our logits, loss and full megatron-core gradients vs transformers on the same batch."""
    ref, ref_grads, config = _hf_reference(**(overrides or {}))
    assert rel_err(logits, ref.logits) <= TOL
    assert abs(loss.item() - ref.loss.item()) <= TOL * ref.loss.item()
    grads = hf_grads_from_mcore(full_grads, config)
    assert set(grads) == set(ref_grads)
    assert {"model.layers.1.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"} <= set(grads)
    for name, grad in ref_grads.items():
        assert rel_err(grads[name], grad) <= TOL, name


@pytest.mark.parametrize("overrides", VARIANTS.values(), ids=VARIANTS.keys())
def test_one_process_matches_transformers(overrides):
    ours = hf_megatron.from_pretrained(tiny_hf_model("qwen3", **overrides)).train()
    assert ours.config.qk_layernorm and ours.config.kv_channels == 32
    ids, labels = _batch()
    out = ours(ids, labels=labels)
    out.loss.backward()
    _assert_matches_transformers(out.logits, out.loss, merge_shards([local_grads(ours)], ours.config), overrides)


def test_config_adapter_and_megatron_args():
    config = ModelConfig.from_hf(tiny_config("qwen3"))
    assert (config.qk_layernorm, config.kv_channels, config.add_qkv_bias, config.sliding_window) == (True, 32, False, None)
    assert architectures.hf_class_name("qwen3") == "Qwen3ForCausalLM"
    for overrides, message in [(dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
                                "use_sliding_window=True on 1 of 2 layers"),
                               (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}),
                                "unsupported rope type 'yarn'")]:
        with pytest.raises(ConfigError, match=message) as error:
            ModelConfig.from_hf(tiny_config("qwen3", **overrides))
        assert "\n" not in str(error.value)
    # Megatron-LM's flags: --qk-layernorm with RMSNorm + RoPE + SwiGLU and no bias is Qwen3
    args = {k: v for k, v in vars(build_args(config, tp=2)).items() if k != "hf_config"}
    assert args["qk_layernorm"] is True  # written, so Megatron-LM builds the q/k norms too
    without = {k: v for k, v in args.items() if k != "qk_layernorm"}
    assert architectures.hf_config_from_megatron_args(without)["model_type"] == "llama"
    read = architectures.hf_config_from_megatron_args(args)
    assert read["model_type"] == "qwen3" and read["architectures"] == ["Qwen3ForCausalLM"]
    assert ModelConfig.from_hf(read) == config
    with pytest.raises(ConfigError, match="matches none of"):
        architectures.hf_config_from_megatron_args({**args, "qk_layernorm": True, "add_qkv_bias": True})


def _mcore_logits(tp_rank, megatron_dir):
    """megatron-core's logits (this TP rank's vocab shard) on our converted tp=2 rank file."""
    from megatron.core import parallel_state, tensor_parallel
    from hf_megatron.checkpoint.load import open_megatron
    from hf_megatron.checkpoint.unpickle import safe_load

    # CPU stand-ins: megatron-core puts RoPE tables on the current CUDA device and forks a CUDA
    # RNG state around attention dropout (0 here, in eval: nothing is drawn)
    torch.cuda.current_device = lambda: "cpu"
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    parallel_state.initialize_model_parallel(2, 1)
    try:
        mcore = _mcore_model(open_megatron(megatron_dir).config, 0, tp=2, pp=1).eval()
        mcore.load_state_dict(safe_load(f"{megatron_dir}/release/mp_rank_{tp_rank:02d}/model_optim_rng.pt")["model"],
                              strict=True)
        ids, _ = _batch()
        causal = torch.triu(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool), 1)[None, None]  # True: masked
        with torch.no_grad():
            return mcore(ids, torch.arange(ids.shape[1])[None].expand_as(ids), attention_mask=causal)
    finally:
        parallel_state.destroy_model_parallel()


def _worker(rank, world, megatron_tp2):
    from hf_megatron.parallel import state
    from hf_megatron.training.trainer import sync_sequence_parallel_grads

    state.initialize(tp=world)
    tp = {}
    for sp in (False, True):
        model = hf_megatron.from_pretrained(tiny_hf_model("qwen3"), sequence_parallel=sp)
        ids, labels = _batch()
        out = model(ids, labels=labels)
        out.loss.backward()
        sync_sequence_parallel_grads(model.parameters())  # q/k norms (and SP norms): summed over TP
        tags = {n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)}
        tp[sp] = (out.logits, out.loss, local_grads(model), tags)
    state.reset()
    pp = pipeline_worker(rank, world, 1, 2, PP2_CASES)
    state.reset()
    return {"tp": tp, "pp": pp, "mcore": _mcore_logits(rank, megatron_tp2)}


def test_tp2_pp2_and_megatron_core_match_transformers(qwen3_source, tmp_path):
    megatron_tp2 = tmp_path / "tp2"
    hf_to_megatron(qwen3_source, megatron_tp2, tp=2)
    per_rank = run_distributed(_worker, 2, (str(megatron_tp2),))
    config = ModelConfig.from_hf(tiny_config("qwen3"))
    qk_norms = {f"decoder.layers.{i}.self_attention.{n}_layernorm.weight" for i in range(2) for n in "qk"}
    for sp in (False, True):
        for rank_result in per_rank:
            logits, loss, _, tags = rank_result["tp"][sp]
            assert qk_norms <= tags  # tagged at tp > 1 with or without sequence parallelism
            assert rel_err(logits, _hf_reference()[0].logits) <= TOL
        grads = merge_shards([r["tp"][sp][2] for r in per_rank], config)
        _assert_matches_transformers(per_rank[0]["tp"][sp][0], per_rank[0]["tp"][sp][1], grads)
    for case, (arch, *_rest) in enumerate(PP2_CASES):
        check_case([r["pp"] for r in per_rank], case, arch, tp=1)
    # megatron-core: each TP rank holds half of the padded vocabulary
    mcore_logits = torch.cat([r["mcore"] for r in per_rank], dim=-1)[..., :VOCAB]
    reference = AutoModelForCausalLM.from_pretrained(qwen3_source, local_files_only=True).eval()
    with torch.no_grad():
        expected = reference(_batch()[0]).logits
    assert rel_err(mcore_logits, expected) <= TOL


def test_cli_round_trip_is_bit_identical_and_verifies(qwen3_source, tmp_path, capsys):
    back = cli_round_trip(qwen3_source, tmp_path, capsys)
    written = json.loads((back / "config.json").read_text())
    assert written["architectures"] == ["Qwen3ForCausalLM"] and written["head_dim"] == 32
    assert type(AutoModelForCausalLM.from_pretrained(back, local_files_only=True)).__name__ == "Qwen3ForCausalLM"

"""OLMo 2, Phi-3, Gemma 2 and Gemma 3 (text) against transformers, on random tiny models (tiny.py:
2 layers, hidden 64, every norm weight random, fp32 on CPU).

(a) one process: logits, loss and every gradient equal transformers (rel <= 1e-5), per family
    and variant (biases, rope variants, ...);
(b) one spawned gloo run of 2 processes for all families: tp=2 with and without sequence
    parallelism, and pp=2 (1F1B, 4 layers, 4 micro batches with padding) -- each against the
    single-process transformers model; megatron-core's GPTModel loads our tp=2 Phi-3 rank files
    (the one family of these it can build, see the README) and gives transformers' logits;
(c) `hf-megatron convert` HF -> Megatron (tp2 x pp2) -> HF is bit-identical and --verify passes;
(d) config adapters: the family's options land in ModelConfig; unsupported variants are one-line
    ConfigErrors naming the field.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_megatron
from dist import run_distributed
from hf_megatron import ModelConfig, architectures
from test_convert_helpers import cli_round_trip, save_hf
from hf_megatron.conversion.convert import hf_to_megatron
from test_qwen3 import _mcore_logits
from test_pipeline import full_tensors, hf_reference, micro_batches, pipeline_worker
from test_tensor_parallel import _batch
from tiny import VOCAB, hf_grads_from_mcore, local_grads, merge_shards, rel_err, tiny_hf_model

TOL = 1e-5
FAMILIES = ["olmo2", "phi3", "gemma2", "gemma3_text"]
EXPECTED_QK_NORM = {"olmo2": {"ProjectionRMSNorm"}, "phi3": set(), "gemma2": set(), "gemma3_text": {"ZeroCenteredRMSNorm"}}
HF_CLASSES = {"olmo2": "Olmo2ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
              "gemma3_text": "Gemma3ForCausalLM"}
PHI3_ROPE = dict(rope_theta=10000.0, partial_rotary_factor=0.5, short_factor=[1.0, 1.5, 2.0, 3.0],
                 long_factor=[1.5, 2.5, 4.0, 8.0])
VARIANTS = {  # fp32 and float64
    "phi3": {"longrope-short": dict(rope_parameters=dict(rope_type="longrope", original_max_position_embeddings=32,
                                                          **PHI3_ROPE)),
             "su-full-rotary": dict(rope_scaling=dict(type="su", short_factor=[1.0] * 8, long_factor=[2.0] * 8,
                                                             original_max_position_embeddings=8),
                                    rope_parameters=None, original_max_position_embeddings=8, sliding_window=6),
             "default-rope": dict(rope_parameters=dict(rope_type="default", rope_theta=500.0, partial_rotary_factor=0.75))},
    # no caps: the SDPA path with query_pre_attn_scalar's scale
    "gemma2": {"biased-untied-uncapped": dict(attention_bias=True, tie_word_embeddings=False,
                                              attn_logit_softcapping=None, final_logit_softcapping=None)},
    # attn_logit_softcapping is stored but unused by transformers' Gemma 3: so here too
    "gemma3_text": {"capped-4-layers-pattern-4": dict(attn_logit_softcapping=0.5, final_logit_softcapping=0.3,
                                                      num_hidden_layers=4, sliding_window_pattern=4)},
}
FP64_VARIANTS = {  # float64 only: fp32 q_norm grads of olmo2 with biases come to rel 1.05e-5 (rounding)
    "olmo2": {"attention-bias": dict(attention_bias=True)},
}
ONE_PROCESS = [(family, {}) for family in FAMILIES] + [
    (family, overrides) for family in FAMILIES for overrides in VARIANTS.get(family, {}).values()]
ONE_PROCESS_IDS = FAMILIES + [f"{family}-{name}" for family in FAMILIES for name in VARIANTS.get(family, {})]
FP64_ONLY = [(family, overrides) for family in FAMILIES for overrides in FP64_VARIANTS.get(family, {}).values()]
FP64_ONLY_IDS = [f"{family}-{name}" for family in FAMILIES for name in FP64_VARIANTS.get(family, {})]


def hf_reference_one(arch: str, **overrides):
    """transformers' output and gradients on the test batch, and the ModelConfig it maps to."""
    hf = tiny_hf_model(arch, **overrides)
    ids, labels = _batch()
    out = hf(input_ids=ids, labels=labels)
    out.loss.backward()
    return out, {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}, ModelConfig.from_hf(hf.config)


def assert_matches_transformers(arch, logits, loss, full_grads, overrides=None):
    """Our logits, loss and full megatron-core gradients vs transformers on the same batch."""
    ref, ref_grads, config = hf_reference_one(arch, **(overrides or {}))
    assert rel_err(logits, ref.logits) <= TOL, arch
    assert abs(loss.item() - ref.loss.item()) <= TOL * ref.loss.item(), arch
    grads = hf_grads_from_mcore(full_grads, config)
    assert set(grads) == set(ref_grads), arch
    for name, grad in ref_grads.items():
        assert rel_err(grads[name], grad) <= TOL, (arch, name)


@pytest.mark.parametrize("arch,overrides", ONE_PROCESS, ids=ONE_PROCESS_IDS)
def test_one_process_matches_transformers(arch, overrides):
    ours = hf_megatron.from_pretrained(tiny_hf_model(arch, **overrides)).train()
    ids, labels = _batch()
    out = ours(ids, labels=labels)
    out.loss.backward()
    assert_matches_transformers(arch, out.logits, out.loss, merge_shards([local_grads(ours)], ours.config), overrides)


# Gemma's norms and attention softmax run in fp32 by design (in transformers and here), so a
# float64 Gemma still rounds to fp32 inside: left out
FP64 = [(arch, overrides) for arch, overrides in ONE_PROCESS + FP64_ONLY if not arch.startswith("gemma")]
FP64_IDS = [name for name, (arch, _) in zip(ONE_PROCESS_IDS + FP64_ONLY_IDS, ONE_PROCESS + FP64_ONLY)
            if not arch.startswith("gemma")]


@pytest.mark.parametrize("arch,overrides", FP64, ids=FP64_IDS)
def test_float64_agrees_to_rounding(arch, overrides):
    """The same comparison in float64 (rel <= 1e-12): what remains in fp32 is rounding, not a
    different formula -- also for the variants whose fp32 gradients reach rel ~1e-5 through
    cancellation in sums over tokens (listed in FP64_ONLY)."""
    hf = tiny_hf_model(arch, **overrides).double()
    ours = hf_megatron.from_pretrained(hf, dtype=torch.float64).train()
    ids, labels = _batch()
    ref, out = hf(input_ids=ids, labels=labels), ours(ids, labels=labels)
    ref.loss.backward()
    out.loss.backward()
    assert rel_err(out.logits, ref.logits) <= 1e-12
    grads = hf_grads_from_mcore(merge_shards([local_grads(ours)], ours.config), ours.config)
    for name, p in hf.named_parameters():
        assert rel_err(grads[name], p.grad) <= 1e-12, name


# ------------------------------------------------------------------ tp=2 and pp=2, one spawned run


def _tp_worker(rank, world):
    from hf_megatron.parallel import state
    from hf_megatron.training.trainer import sync_sequence_parallel_grads

    state.initialize(tp=world)
    results = {}
    for arch in FAMILIES:
        for sp in (False, True):
            model = hf_megatron.from_pretrained(tiny_hf_model(arch), sequence_parallel=sp)
            ids, labels = _batch()
            out = model(ids, labels=labels)
            out.loss.backward()
            sync_sequence_parallel_grads(model.parameters())
            kinds = {type(m).__name__ for n, m in model.named_modules() if n.endswith("q_layernorm")}
            results[arch, sp] = (out.logits, out.loss, local_grads(model), kinds)
    state.reset()
    return results


def _worker(rank, world, phi3_tp2):
    from hf_megatron.parallel import state
    tp = _tp_worker(rank, world)
    pp = pipeline_worker(rank, world, 1, 2, [(arch, 1, None, {}) for arch in FAMILIES])
    state.reset()
    return {"tp": tp, "pp": pp, "mcore": _mcore_logits(rank, phi3_tp2)}


def check_pipeline_case(per_rank, case, arch):
    """Loss sums and every gradient of the pp=2 run vs one transformers process (tied tables:
    the last stage's output-layer copy gets the embedding's full gradient too)."""
    mbs = micro_batches()
    ref_loss, ref_tokens, ref_grads, hf = hf_reference(arch, mbs)
    config = ModelConfig.from_hf(hf.config)
    for rank_results in per_rank:
        for key in ("out", "eval"):
            result = rank_results[case][key]
            assert int(result["num_tokens"]) == ref_tokens
            assert abs(result["loss_sum"].item() - ref_loss) <= TOL * ref_loss, arch
    grads = full_tensors(per_rank, case, "grad", config, 1)
    if config.tie_word_embeddings:
        embedding = "model.embed_tokens.weight"
        assert rel_err(grads.pop("output_layer.weight"), ref_grads[embedding]) <= TOL, arch
        ref_grads.pop("lm_head.weight", None)
    ours = hf_grads_from_mcore(grads, config)
    assert set(ours) == set(ref_grads)
    for name, grad in ref_grads.items():
        assert rel_err(ours[name], grad) <= TOL, (arch, name)


# megatron-core rotates the first rotary_percent of each head as we do, but has no longrope
PHI3_MCORE = dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))


def test_tp2_pp2_and_megatron_core_match_transformers(tmp_path):
    phi3_source, phi3_tp2 = save_hf(tmp_path / "phi3", "phi3", **PHI3_MCORE), tmp_path / "phi3_tp2"
    hf_to_megatron(phi3_source, phi3_tp2, tp=2)
    per_rank = run_distributed(_worker, 2, (str(phi3_tp2),))
    for arch in FAMILIES:
        config = ModelConfig.from_hf(tiny_hf_model(arch).config)
        for sp in (False, True):
            logits, loss, _, kinds = per_rank[0]["tp"][arch, sp]
            assert kinds == EXPECTED_QK_NORM[arch]  # OLMo 2's span the TP shards
            grads = merge_shards([r["tp"][arch, sp][2] for r in per_rank], config)
            assert_matches_transformers(arch, logits, loss, grads)
            assert rel_err(per_rank[1]["tp"][arch, sp][0], logits) <= TOL
    for case, arch in enumerate(FAMILIES):
        check_pipeline_case([r["pp"] for r in per_rank], case, arch)
    # megatron-core's GPTModel on our Phi-3 rank files: each TP rank holds half the padded vocabulary
    mcore_logits = torch.cat([r["mcore"] for r in per_rank], dim=-1)[..., :VOCAB]
    reference = AutoModelForCausalLM.from_pretrained(phi3_source, local_files_only=True).eval()
    with torch.no_grad():
        assert rel_err(mcore_logits, reference(_batch()[0]).logits) <= TOL


# ------------------------------------------------------------------ conversion


@pytest.mark.parametrize("arch", FAMILIES)
def test_cli_round_trip_is_bit_identical_and_verifies(arch, tmp_path, capsys):
    back = cli_round_trip(save_hf(tmp_path / "hf", arch), tmp_path, capsys)
    written = json.loads((back / "config.json").read_text())
    assert written["architectures"] == [HF_CLASSES[arch]] and written["model_type"] == arch
    assert type(AutoModelForCausalLM.from_pretrained(back, local_files_only=True)).__name__ == HF_CLASSES[arch]
    assert architectures.hf_class_name(arch) == HF_CLASSES[arch]


# ------------------------------------------------------------------ config adapters

EXPECTED_FIELDS = {
    "olmo2": dict(qk_layernorm=True, qk_layernorm_scope="projection", pre_layernorm=False, post_layernorm=True),
    "phi3": dict(rotary_percent=0.5, rope_scaling=dict(
        rope_type="longrope", short_factor=PHI3_ROPE["short_factor"], long_factor=PHI3_ROPE["long_factor"],
        original_max_position_embeddings=8, factor=8.0, attention_factor=(1 + math.log(8) / math.log(8)) ** 0.5)),
    "gemma2": dict(activation="geglu", pre_layernorm=True, post_layernorm=True, layernorm_zero_centered_gamma=True,
                   embedding_multiplier=8.0, softmax_scale=24 ** -0.5, attn_logit_softcapping=0.5,
                   final_logit_softcapping=0.2, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                   tie_word_embeddings=True),
    "gemma3_text": dict(qk_layernorm=True, qk_layernorm_scope="head", layernorm_zero_centered_gamma=True,
                        post_layernorm=True, rotary_base=50000.0, local_rotary_base=100.0, attn_logit_softcapping=None,
                        rope_scaling=dict(rope_type="linear", factor=2.0),
                        layer_types=["sliding_attention", "full_attention"]),
}


@pytest.mark.parametrize("arch", FAMILIES)
def test_config_adapter_sets_the_family_options(arch):
    config = ModelConfig.from_hf(tiny_hf_model(arch).config)
    assert {k: getattr(config, k) for k in EXPECTED_FIELDS[arch]} == EXPECTED_FIELDS[arch]


BAD_CONFIGS = [  # (family, HF config dict changes, the error names the field)
    ("phi3", dict(rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=1e4)),
     r"phi3 rope_parameters.rope_type 'dynamic' is not supported; supported: default, longrope, su, yarn"),
    ("phi3", dict(rope_parameters=dict(rope_type="longrope", rope_theta=1e4, partial_rotary_factor=0.5,
                                       short_factor=[1.0], long_factor=[1.0] * 4, original_max_position_embeddings=8)),
     r"phi3 rope_parameters.short_factor must be a list of 4 numbers"),
    ("phi3", dict(rope_parameters=None, rope_scaling=dict(type="linear", factor=2.0)),
     r"phi3 rope_scaling.rope_type 'linear' is not supported"),
    ("gemma2", dict(hidden_activation="silu"), r"gemma2 hidden_activation 'silu' is not supported"),
    ("gemma3_text", dict(rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     r"gemma3_text rope_parameters.full_attention: unsupported rope type 'yarn'"),
    ("gemma3_text", dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
     r"gemma3_text rope_parameters.sliding_attention.rope_type 'linear' is not supported"),
    ("gemma3_text", dict(use_bidirectional_attention=True), r"use_bidirectional_attention=True is not supported"),
]


@pytest.mark.parametrize("arch,changes,message", BAD_CONFIGS)
def test_unsupported_variants_are_one_line_config_errors(arch, changes, message):
    data = {**tiny_hf_model(arch).config.to_dict(), **changes}
    with pytest.raises(hf_megatron.ConfigError, match=message) as error:
        ModelConfig.from_hf(data)
    assert "\n" not in str(error.value)


def test_megatron_flags_alone_read_partial_rotary_as_phi3():
    """Megatron-LM's flags (our args without hf_config): Llama's with --rotary-percent 0.5 are
    Phi-3 with partial_rotary_factor 0.5, and give back the same ModelConfig; Gemma's are no
    family megatron-core knows (one-line error)."""
    from hf_megatron.checkpoint.args import build_args
    config = ModelConfig.from_hf(tiny_hf_model("phi3", **PHI3_MCORE).config)
    args = {k: v for k, v in vars(build_args(config, tp=2)).items() if k != "hf_config"}
    assert args["rotary_percent"] == 0.5
    read = architectures.hf_config_from_megatron_args(args)
    assert read["model_type"] == "phi3" and read["architectures"] == ["Phi3ForCausalLM"]
    assert ModelConfig.from_hf(read) == config
    assert architectures.hf_config_from_megatron_args({**args, "rotary_percent": 1.0})["model_type"] == "llama"
    gemma = {k: v for k, v in vars(build_args(ModelConfig.from_hf(tiny_hf_model("gemma2").config))).items()
             if k != "hf_config"}
    assert gemma["apply_layernorm_1p"] is True
    with pytest.raises(hf_megatron.ConfigError, match="matches none of"):
        architectures.hf_config_from_megatron_args(gemma)

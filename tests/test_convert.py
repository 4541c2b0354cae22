"""HF -> Megatron (tp, pp) -> HF round trips are bit-identical; reshard is lossless; outputs load
in transformers (from_pretrained + AutoTokenizer, offline) and generate."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_megatron.conversion.convert import hf_to_megatron, megatron_to_hf, reshard
from hf_megatron.checkpoint.load import open_megatron
from hf_megatron.checkpoint.unpickle import safe_load
from test_convert_helpers import ARCHS, assert_identical, hf_sources, hf_tensors, save_hf  # noqa: F401

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_is_bit_identical(arch, hf_sources, tmp_path):
    source = hf_tensors(hf_sources[arch])
    for tp, pp in LAYOUTS:
        megatron, back = tmp_path / f"m{tp}{pp}", tmp_path / f"h{tp}{pp}"
        hf_to_megatron(hf_sources[arch], megatron, tp=tp, pp=pp)
        assert (megatron / "latest_checkpointed_iteration.txt").read_text() == "release"
        ranks = sorted(p.name for p in (megatron / "release").iterdir())
        expected = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") for t in range(tp) for p in range(pp)]
        assert ranks == sorted(expected)
        megatron_to_hf(megatron, back)
        assert_identical(source, hf_tensors(back))
    # the last output is a complete save_pretrained folder: transformers loads it and generates
    model = AutoModelForCausalLM.from_pretrained(back, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(back, local_files_only=True)
    ids = tokenizer("hello world", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert out.shape == (1, ids.shape[1] + 4)
    assert json.loads((back / "config.json").read_text())["model_type"] == arch
    assert (back / "generation_config.json").is_file()


def test_rank_files_hold_megatron_fields(hf_sources, tmp_path):
    hf_to_megatron(hf_sources["llama"], tmp_path / "m", tp=2, pp=2)
    payload = safe_load(tmp_path / "m/release/mp_rank_01_001/model_optim_rng.pt")
    args = payload["args"]
    assert payload["checkpoint_version"] == 3.0
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 2)
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.num_query_groups) == (2, 64, 4, 2)
    assert args.group_query_attention and args.swiglu and args.untie_embeddings_and_output_weights
    assert args.padded_vocab_size == 512  # 300 -> multiple of 128 * tp
    assert args.normalization == "RMSNorm" and args.position_embedding_type == "rope"
    assert args.hf_config["model_type"] == "llama"
    # stage-local layer numbers, TP shards: the last stage holds global layer 1 as layer 0
    model = payload["model"]
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in model and "decoder.layers.1.mlp.linear_fc1.weight" not in model
    assert model["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (64, 64)  # (4 + 2*2) * 16 / 2
    assert model["output_layer.weight"].shape == (256, 64)
    assert "embedding.word_embeddings.weight" not in model


def test_reshard_is_lossless(tmp_path):
    src = save_hf(tmp_path / "hf", "llama", num_attention_heads=8, num_key_value_heads=4)
    source = hf_tensors(src)
    hf_to_megatron(src, tmp_path / "m22", tp=2, pp=2)
    reshard(tmp_path / "m22", tmp_path / "m11", tp=1, pp=1)
    reshard(tmp_path / "m11", tmp_path / "m41", tp=4, pp=1, verify=True)
    full = {k: open_megatron(tmp_path / k).full_state_dict() for k in ("m22", "m11", "m41")}
    for name, tensor in full["m22"].items():
        assert torch.equal(full["m11"][name], tensor) and torch.equal(full["m41"][name], tensor), name
    assert sorted(p.name for p in (tmp_path / "m41/release").iterdir()) == [f"mp_rank_0{t}" for t in range(4)]
    megatron_to_hf(tmp_path / "m41", tmp_path / "back")
    assert_identical(source, hf_tensors(tmp_path / "back"))
    assert (tmp_path / "back/tokenizer.json").is_file()


def test_virtual_pipeline_round_trip(tmp_path):
    src = save_hf(tmp_path / "hf", "qwen2", num_hidden_layers=4)
    hf_to_megatron(src, tmp_path / "m", tp=1, pp=2, vpp=2, verify=True)
    payload = safe_load(tmp_path / "m/release/mp_rank_00_001/model_optim_rng.pt")
    assert set(k for k in payload if k.startswith("model")) == {"model0", "model1"}
    assert "output_layer.weight" in payload["model1"] and "output_layer.weight" not in payload["model0"]
    megatron_to_hf(tmp_path / "m", tmp_path / "back")
    assert_identical(hf_tensors(src), hf_tensors(tmp_path / "back"))


def test_sharded_bf16_output_loads_in_transformers(hf_sources, tmp_path):
    hf_to_megatron(hf_sources["llama"], tmp_path / "m", tp=2, pp=1)
    report = megatron_to_hf(tmp_path / "m", tmp_path / "back", dtype="bf16", max_shard_size="60KB", verify=True)
    assert len(report["files"]) > 1 and (tmp_path / "back/model.safetensors.index.json").is_file()
    assert report["verify"].top1_agreement == 1.0
    source = {k: v.to(torch.bfloat16) for k, v in hf_tensors(hf_sources["llama"]).items()}
    assert_identical(source, hf_tensors(tmp_path / "back"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "back", local_files_only=True)
    assert model.dtype == torch.bfloat16
    reference = AutoModelForCausalLM.from_pretrained(hf_sources["llama"], local_files_only=True, dtype=torch.bfloat16)
    ids = torch.tensor([[1, 5, 9, 200, 7]])
    assert torch.equal(model(ids).logits, reference(ids).logits)


def test_base_model_names_without_prefix_are_read(hf_sources, tmp_path):
    """The Hub's gpt2 stores `h.0.attn.c_attn.weight`, not `transformer.h.0...`."""
    import shutil
    from safetensors.torch import save_file
    src = tmp_path / "bare"
    shutil.copytree(hf_sources["gpt2"], src)
    tensors = hf_tensors(src)
    save_file({k.removeprefix("transformer."): v for k, v in tensors.items()}, str(src / "model.safetensors"),
              metadata={"format": "pt"})
    hf_to_megatron(src, tmp_path / "m", tp=2)
    megatron_to_hf(tmp_path / "m", tmp_path / "back")
    assert_identical(tensors, hf_tensors(tmp_path / "back"))


def test_any_layout_loads_into_a_single_process_model(hf_sources, tmp_path):
    from hf_megatron.config import ModelConfig
    from hf_megatron.conversion.hf_io import CheckpointError
    from hf_megatron.checkpoint.load import load_megatron_weights
    from hf_megatron.model.gpt import GPTModel
    from tiny import rel_err
    hf_to_megatron(hf_sources["mistral"], tmp_path / "m", tp=2, pp=2)
    config = ModelConfig.from_hf(json.loads((hf_sources["mistral"] / "config.json").read_text()))
    model = GPTModel(config).eval()
    load_megatron_weights(model, tmp_path / "m")
    reference = AutoModelForCausalLM.from_pretrained(hf_sources["mistral"], local_files_only=True).eval()
    ids = torch.tensor([[4, 8, 15, 16, 23, 42, 108, 7, 9, 250, 1, 2]])  # longer than the sliding window
    with torch.no_grad():
        assert rel_err(model(ids).logits, reference(ids).logits) <= 1e-5
    gpt2 = GPTModel(ModelConfig.from_hf(json.loads((hf_sources["gpt2"] / "config.json").read_text())))
    with pytest.raises(CheckpointError, match=r"another model than the one built: model_type mistral \(the model.s: gpt2\)"):
        load_megatron_weights(gpt2, tmp_path / "m")

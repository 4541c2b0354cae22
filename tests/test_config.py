"""ModelConfig adapters, unsupported inputs, and from_pretrained on a save_pretrained folder."""
import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig

import hf_megatron
from hf_megatron import ConfigError, ModelConfig
from tiny import VOCAB, rel_err, tiny_config, tiny_hf_model


def test_adapters_read_each_architecture():
    gpt2 = ModelConfig.from_hf(tiny_config("gpt2"))
    assert (gpt2.position_embedding_type, gpt2.normalization, gpt2.activation) == ("learned_absolute", "LayerNorm", "gelu_tanh")
    assert gpt2.tie_word_embeddings and gpt2.add_qkv_bias and gpt2.add_mlp_bias
    llama = ModelConfig.from_hf(tiny_config("llama"))
    assert (llama.normalization, llama.activation, llama.num_query_groups) == ("RMSNorm", "swiglu", 2)
    assert llama.rope_scaling["rope_type"] == "llama3" and llama.rotary_base == 500000.0
    qwen2 = ModelConfig.from_hf(tiny_config("qwen2"))
    assert qwen2.add_qkv_bias and not qwen2.add_proj_bias and not qwen2.tie_word_embeddings
    assert ModelConfig.from_hf(tiny_config("mistral")).sliding_window == 8
    assert llama.padded_vocab_size(1) == 384 and llama.padded_vocab_size(4) == 512


def test_transformers_4_style_rope_fields_are_read():
    data = tiny_config("llama").to_dict()
    data.pop("rope_parameters", None)
    data.update(rope_theta=1234.0, rope_scaling={"type": "linear", "factor": 2.0})
    config = ModelConfig.from_hf(data)
    assert config.rotary_base == 1234.0 and config.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_unsupported_architecture_is_one_clear_error():
    bert = AutoConfig.for_model("bert")
    with pytest.raises(ConfigError, match=r"unsupported model_type 'bert'; supported: gemma2, gemma3_text, gpt2, llama, mistral, olmo2, phi3, qwen2, qwen3"):
        ModelConfig.from_hf(bert)


def test_unsupported_rope_type_is_one_clear_error():
    data = tiny_config("llama").to_dict()
    data["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    with pytest.raises(ConfigError, match=r"unsupported rope type 'yarn'.*supported: default, linear, llama3"):
        ModelConfig.from_hf(data)


def test_from_pretrained_reads_a_save_pretrained_folder_offline(tmp_path):
    hf = tiny_hf_model("qwen2").eval()
    hf.save_pretrained(tmp_path / "qwen2")
    model = hf_megatron.from_pretrained(tmp_path / "qwen2").eval()
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(4))
    assert rel_err(model(ids).logits, hf(input_ids=ids).logits) <= 1e-5


def test_from_pretrained_on_a_bad_folder_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config("llama").to_dict()))
    with pytest.raises(ValueError, match=r"no model.safetensors"):
        hf_megatron.from_pretrained(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"empty/config.json: missing"):
        hf_megatron.from_pretrained(empty)


def test_cli_help_runs():
    result = subprocess.run([sys.executable, "-m", "hf_megatron.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "hf-megatron" in result.stdout

"""What a user's HF folder may hold, and what conversion and `hf_megatron.from_pretrained` make of it,
judged against transformers' own `from_pretrained` of the same folder: an untied GPT-2 head is kept,
a config.json that contradicts the weights (tied but a different lm_head, tensors the model has no
place for) is a one-line error, and the model comes back as transformers returns it (eval mode,
its dtype)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_megatron
from hf_megatron.checkpoint.unpickle import safe_load
from hf_megatron.cli import main
from test_convert_helpers import assert_identical, cli_fails as _fails, hf_tensors, save_hf

IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 64, 128, 1]])


def _reference_logits(folder, **kwargs) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, **kwargs)
    with torch.no_grad():
        return model(IDS).logits


def test_untied_gpt2_head_is_kept_both_ways(tmp_path, capsys):
    src = save_hf(tmp_path / "untied", "gpt2", tie_word_embeddings=False)
    stored = hf_tensors(src)
    assert not torch.equal(stored["lm_head.weight"], stored["transformer.wte.weight"])  # really untied
    meg, back = tmp_path / "meg", tmp_path / "back"
    assert main(["convert", "hf-to-megatron", "--hf", str(src), "--out", str(meg), "--tp", "2", "--pp", "2",
                 "--verify"]) == 0
    assert "top-1 agreement 100.0%" in capsys.readouterr().out
    last = safe_load(meg / "release/mp_rank_01_001/model_optim_rng.pt")
    assert last["args"].untie_embeddings_and_output_weights is True
    # the second tp rank's half of the padded vocabulary (300 -> 512): rows 256..299 of lm_head
    assert torch.equal(last["model"]["output_layer.weight"][:44], stored["lm_head.weight"][256:])
    assert main(["convert", "megatron-to-hf", "--megatron", str(meg), "--out", str(back), "--verify"]) == 0
    capsys.readouterr()
    assert_identical(stored, hf_tensors(back))
    reference = _reference_logits(src)
    torch.testing.assert_close(_reference_logits(back), reference, rtol=0, atol=0)
    with torch.no_grad():
        ours = hf_megatron.from_pretrained(src)(IDS).logits
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


def _with_tensors(src, folder, **extra: torch.Tensor):
    """A copy of the save_pretrained folder `src` whose model.safetensors also holds `extra`."""
    import shutil
    from safetensors.torch import save_file
    shutil.copytree(src, folder)
    save_file({**hf_tensors(src), **extra}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_tied_config_with_a_different_lm_head_is_refused(tmp_path, capsys):
    src = save_hf(tmp_path / "tied", "llama", tie_word_embeddings=True)
    embedding = hf_tensors(src)["model.embed_tokens.weight"]
    other = _with_tensors(src, tmp_path / "other", **{"lm_head.weight": embedding + 1.0})
    weights = str(other / "model.safetensors")
    _fails(["convert", "hf-to-megatron", "--hf", str(other), "--out", str(tmp_path / "o")], capsys,
           weights, "lm_head.weight", "tie_word_embeddings", str(other / "config.json"))
    assert not (tmp_path / "o").exists()
    with pytest.raises(hf_megatron.errors.CheckpointError, match="tie_word_embeddings"):
        hf_megatron.from_pretrained(other)
    # the same values (older save_pretrained wrote both): accepted, and the logits are transformers'
    same = _with_tensors(src, tmp_path / "same", **{"lm_head.weight": embedding.clone()})
    assert main(["convert", "hf-to-megatron", "--hf", str(same), "--out", str(tmp_path / "m"), "--verify"]) == 0
    assert "top-1 agreement 100.0%" in capsys.readouterr().out
    with torch.no_grad():
        torch.testing.assert_close(hf_megatron.from_pretrained(same)(IDS).logits, _reference_logits(same),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch,extra", [
    ("llama", "model.layers.0.self_attn.q_proj.bias"),  # attention_bias is false
    ("llama", "model.layers.2.mlp.down_proj.weight"),  # num_hidden_layers is 2
    ("gpt2", "transformer.h.0.attn.c_attn.scale"),  # no such tensor in GPT-2
    ("gpt2", "score.weight"),  # a classification head
])
def test_unexpected_tensors_are_refused(arch, extra, tmp_path, capsys):
    src = save_hf(tmp_path / arch, arch)
    folder = _with_tensors(src, tmp_path / "extra", **{extra: torch.zeros(64)})
    _fails(["convert", "hf-to-megatron", "--hf", str(folder), "--out", str(tmp_path / "o")], capsys,
           str(folder / "model.safetensors"), repr(extra))
    assert not (tmp_path / "o").exists()
    with pytest.raises(hf_megatron.errors.CheckpointError, match="unexpected tensor"):
        hf_megatron.from_pretrained(folder)


@pytest.mark.parametrize("arch,buffers", [
    ("gpt2", ("transformer.h.0.attn.bias", "transformer.h.1.attn.bias", "h.0.attn.masked_bias")),
    ("llama", ("model.layers.0.self_attn.rotary_emb.inv_freq",)),
])
def test_buffers_transformers_ignores_are_accepted(arch, buffers, tmp_path, capsys):
    """Older checkpoints hold the causal-mask (GPT-2) and RoPE frequency buffers: transformers loads
    past them, and so do we, with its logits."""
    src = save_hf(tmp_path / arch, arch)
    folder = _with_tensors(src, tmp_path / "buffers", **{name: torch.ones(1, 1, 64, 64) for name in buffers})
    assert main(["convert", "hf-to-megatron", "--hf", str(folder), "--out", str(tmp_path / "m"), "--verify"]) == 0
    assert "top-1 agreement 100.0%" in capsys.readouterr().out
    with torch.no_grad():
        torch.testing.assert_close(hf_megatron.from_pretrained(folder)(IDS).logits, _reference_logits(folder),
                                   rtol=1e-5, atol=1e-5)


def test_from_pretrained_returns_an_eval_model_as_transformers(tmp_path):
    """Dropout configured > 0: transformers' from_pretrained gives an eval model (dropout off), so its
    logits are deterministic; ours must be the same model in the same mode."""
    src = save_hf(tmp_path / "dropout", "gpt2", resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3)
    model = hf_megatron.from_pretrained(src)
    reference = AutoModelForCausalLM.from_pretrained(src, local_files_only=True)
    assert reference.training is False and model.training is False
    assert not any(module.training for module in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, reference(IDS).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("drop_config_dtype", [False, True])
def test_from_pretrained_dtype_is_transformers_auto(drop_config_dtype, tmp_path):
    """transformers 5 loads in config.json's dtype (or, with none, the weights'): bf16 here."""
    import json
    src = tmp_path / "bf16"
    save_hf(src, "llama")
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(src)
    config = json.loads((src / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    if drop_config_dtype:
        del config["dtype"]
        (src / "config.json").write_text(json.dumps(config))
    reference = AutoModelForCausalLM.from_pretrained(src, local_files_only=True)
    model = hf_megatron.from_pretrained(src)
    assert reference.dtype == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with torch.no_grad():  # both in bf16: equal to bf16 rounding
        torch.testing.assert_close(model(IDS).logits.float(), reference(IDS).logits.float(), rtol=0.02, atol=0.02)
    # an explicit dtype wins, as in transformers
    assert {p.dtype for p in hf_megatron.from_pretrained(src, dtype=torch.float32).parameters()} == {torch.float32}
    # a transformers model object keeps its own dtype
    assert {p.dtype for p in hf_megatron.from_pretrained(reference).parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("value", ["float17", "int64", 5, ["bfloat16"]])
def test_config_dtype_naming_no_floating_dtype_is_refused(value, tmp_path):
    """config.json `dtype: "float17"` (or an int dtype, a number, a list) was silently replaced by the weights'
    dtype; transformers' from_pretrained fails on it (AttributeError).  Now one line naming the file and field."""
    import json
    from hf_megatron.errors import ConfigError
    src = tmp_path / "m"
    save_hf(src, "llama")
    config = json.loads((src / "config.json").read_text())
    config["dtype"] = value
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception):
        AutoModelForCausalLM.from_pretrained(src, local_files_only=True)
    with pytest.raises(ConfigError, match=f"^{src / 'config.json'}: field 'dtype': expected a torch floating dtype"):
        hf_megatron.from_pretrained(src)


def test_gpt2_without_attention_scaling_computes_transformers_logits(tmp_path, capsys):
    """scale_attn_weights=false: scores are q.k, not q.k / sqrt(head_dim)."""
    src = save_hf(tmp_path / "unscaled", "gpt2", scale_attn_weights=False)
    reference = _reference_logits(src)
    assert not torch.allclose(reference, _reference_logits(save_hf(tmp_path / "scaled", "gpt2")), atol=1e-3)
    with torch.no_grad():
        torch.testing.assert_close(hf_megatron.from_pretrained(src)(IDS).logits, reference, rtol=1e-5, atol=1e-5)
    back = tmp_path / "back"
    assert main(["convert", "hf-to-megatron", "--hf", str(src), "--out", str(tmp_path / "m"), "--tp", "2",
                 "--verify"]) == 0
    assert main(["convert", "megatron-to-hf", "--megatron", str(tmp_path / "m"), "--out", str(back), "--verify"]) == 0
    assert "top-1 agreement 100.0%" in capsys.readouterr().out
    assert AutoModelForCausalLM.from_pretrained(back, local_files_only=True).config.scale_attn_weights is False
    torch.testing.assert_close(_reference_logits(back), reference, rtol=0, atol=0)
    # the other GPT-2 scaling switch stays refused, naming the file and the field
    import json
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "scale_attn_by_inverse_layer_idx": True}))
    _fails(["convert", "hf-to-megatron", "--hf", str(src), "--out", str(tmp_path / "o")], capsys,
           str(src / "config.json"), "scale_attn_by_inverse_layer_idx")

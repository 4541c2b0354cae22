"""`--legacy-names`: rank files in Megatron-LM's pre-mcore layout (`language_model.embedding`,
`language_model.encoder.layers.N...`), as older readers take them.

The reader under test is transformers' own `convert_megatron_gpt2_checkpoint.py`.  transformers
5 no longer ships it, so the test fetches the transformers 4.46.3 wheel from the package index
(`pip download --no-deps`, skipped when the index is unreachable) and runs just that file, offline
from then on.  Two things the script assumes are supplied as its users must: torch >= 2.6 loads
with weights_only=True by default, so the run sets TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 (the script
predates it); and it fetches the tokenizer `openai-community/gpt2` from the Hub for
tokenizer_type GPT2BPETokenizer, which is answered with the GPT-2 tokenizer files our checkpoint
names (no network in CI).
"""
from __future__ import annotations

import runpy
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2LMHeadModel

from hf_megatron.checkpoint.load import open_megatron
from hf_megatron.conversion.convert import hf_to_megatron, megatron_to_hf
from hf_megatron.conversion.verify import megatron_logits
from hf_megatron.errors import ParallelConfigError
from test_convert_helpers import assert_identical, hf_sources, hf_tensors, save_hf  # noqa: F401
from test_megatron_interop import gpt2_tokenizer_folder
from tiny import VOCAB, rel_err

SCRIPT = "transformers/models/megatron_gpt2/convert_megatron_gpt2_checkpoint.py"
IDS = torch.tensor([[3, 17, 250, 9, 41, 128, 77, 5, 299, 0, 64, 12]])


@pytest.fixture(scope="session")
def gpt2_script(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("transformers_446")
    try:
        subprocess.run([sys.executable, "-m", "pip", "download", "transformers==4.46.3", "--no-deps", "-q",
                        "-d", str(folder)], check=True, capture_output=True, timeout=180)
    except (subprocess.SubprocessError, OSError) as exc:
        pytest.skip(f"transformers 4.46.3 wheel not downloadable here: {exc}")
    wheel = next(folder.glob("transformers-4.46.3-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        (folder / "convert_megatron_gpt2_checkpoint.py").write_bytes(archive.read(SCRIPT))
    return folder / "convert_megatron_gpt2_checkpoint.py"


def test_transformers_gpt2_script_reads_legacy_names(gpt2_script, tmp_path, monkeypatch):
    src = save_hf(tmp_path / "gpt2", "gpt2")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (src / name).unlink()
    gpt2_tokenizer_folder(src)
    out = tmp_path / "legacy"
    hf_to_megatron(src, out, legacy_names=True)
    rank_file = out / "release/mp_rank_00/model_optim_rng.pt"

    ours_tokenizer = out / "tokenizer"
    real_from_pretrained = AutoTokenizer.from_pretrained.__func__

    def offline(cls, name, *args, **kwargs):
        return real_from_pretrained(cls, ours_tokenizer if name == "openai-community/gpt2" else name, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(offline))
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    monkeypatch.setattr(sys, "argv", [str(gpt2_script), str(rank_file)])
    runpy.run_path(str(gpt2_script), run_name="__main__")  # writes config + pytorch_model.bin next to the file

    converted = GPT2LMHeadModel.from_pretrained(rank_file.parent).eval()
    reference = AutoModelForCausalLM.from_pretrained(src, local_files_only=True).eval()
    assert converted.config.activation_function == "gelu_fast"  # from args.bias_gelu_fusion: tanh GELU
    with torch.no_grad():
        theirs = converted(IDS).logits
        expected = reference(IDS).logits
    ours = megatron_logits(open_megatron(out), IDS)
    assert theirs.shape[-1] == 384  # the script keeps Megatron's padded vocabulary (300 -> 384)
    assert rel_err(theirs[..., :VOCAB], expected) <= 1e-5
    assert rel_err(theirs[..., :VOCAB], ours.reshape(expected.shape)) <= 1e-5


def test_legacy_names_round_trip_at_tp2_pp2(hf_sources, tmp_path):
    out = tmp_path / "legacy22"
    hf_to_megatron(hf_sources["llama"], out, tp=2, pp=2, legacy_names=True)
    from hf_megatron.checkpoint.unpickle import safe_load
    model = safe_load(out / "release/mp_rank_01_001/model_optim_rng.pt")["model"]
    assert sorted(model) == ["language_model"] and {"encoder", "output_layer"} <= set(model["language_model"])
    assert "layers.0.self_attention.query_key_value.weight" in model["language_model"]["encoder"]
    assert list(model["language_model"]["encoder"])[-1] == "final_layernorm.weight"
    megatron_to_hf(out, tmp_path / "back")
    assert_identical(hf_tensors(hf_sources["llama"]), hf_tensors(tmp_path / "back"))


def test_legacy_names_refuse_what_legacy_models_lack(tmp_path):
    src = save_hf(tmp_path / "qwen3", "qwen3")
    with pytest.raises(ParallelConfigError, match="q/k layernorm"):
        hf_to_megatron(src, tmp_path / "out", legacy_names=True)
    assert not (tmp_path / "out").exists()

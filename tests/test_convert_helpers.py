"""Helpers shared by the checkpoint / conversion tests (no tests here): tiny HF folders with a
real tokenizer, and tensor comparisons of safetensors folders."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tiny import tiny_hf_model

ARCHS = ["gpt2", "llama", "mistral", "qwen2"]
TEXTS = ["the quick brown fox jumps over the lazy dog", "megatron meets hugging face",
         "pipeline and tensor parallel checkpoints", "hello world, hello tokens"] * 8


def make_tokenizer(folder: Path, vocab_size: int = 280):
    """A small byte-level BPE trained here, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)
    return fast


def save_hf(folder: Path, arch: str, seed: int = 0, **overrides) -> Path:
    model = tiny_hf_model(arch, seed=seed, **overrides)
    model.save_pretrained(folder)
    make_tokenizer(folder)
    return folder


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a save_pretrained folder (single file or sharded with an index)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    out = {}
    for name in files:
        out.update(load_file(folder / name))
    return out


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b), (sorted(set(a) - set(b)), sorted(set(b) - set(a)))
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.fixture(scope="session")
def hf_sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_sources")
    return {arch: save_hf(root / arch, arch) for arch in ARCHS}


def cli_fails(argv, capsys, *fragments) -> str:
    """`hf-megatron ARGV` exits 2 with a one-line error holding every fragment; returns the line."""
    from hf_megatron.cli import main
    capsys.readouterr()  # what came before (transformers' progress bars)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for fragment in fragments:
        assert fragment in err, err
    return err


def cli_round_trip(source: Path, tmp_path: Path, capsys) -> Path:
    """`hf-megatron convert` HF -> Megatron (tp2 x pp2) -> HF, both with --verify (asserted to
    pass); the tensors come back bit-identical.  Returns the HF folder written back."""
    from hf_megatron.cli import main
    meg, back = tmp_path / "meg", tmp_path / "back"
    assert main(["convert", "hf-to-megatron", "--hf", str(source), "--out", str(meg), "--tp", "2", "--pp", "2",
                 "--verify"]) == 0
    assert "top-1 agreement 100.0%" in capsys.readouterr().out
    assert main(["convert", "megatron-to-hf", "--megatron", str(meg), "--out", str(back), "--verify"]) == 0
    assert "top-1 agreement 100.0%" in capsys.readouterr().out
    assert_identical(hf_tensors(source), hf_tensors(back))
    return back

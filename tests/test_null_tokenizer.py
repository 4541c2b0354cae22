"""`--tokenizer-type NullTokenizer --vocab-size N` is megatron-core's NullTokenizer: ids 0..N-1, eod N,
vocab_size N + 1 -- judged by megatron-core's own object (the wheel, test-only) in preprocess (the
eod --append-eod writes, the ids accepted, the .bin dtype), train (the model's vocabulary: N + 1
padded as Megatron-LM pads it; the checkpoint's args) and conversion of a checkpoint whose args are
Megatron-LM's alone."""
import json
import re

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset
from megatron.core.tokenizers import MegatronTokenizer
from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer as McoreNullTokenizer
from train_cli import base_args, cli_inprocess, make_workspace

from hf_megatron import cli
from hf_megatron.checkpoint.unpickle import safe_load
from hf_megatron.data.tokenizers import build_tokenizer

SHAPE = ["--num-layers", 2, "--hidden-size", 64, "--num-attention-heads", 4]


@pytest.mark.parametrize("vocab", [1, 10, 384, 65499])
def test_eod_vocab_size_and_ids_are_megatron_cores(vocab):
    ours, theirs = build_tokenizer("NullTokenizer", vocab_size=vocab), McoreNullTokenizer(vocab)
    built = MegatronTokenizer.from_pretrained(metadata_path={"library": "null"}, vocab_size=vocab)  # Megatron-LM's way
    assert (ours.eod, ours.vocab_size) == (theirs.eod, theirs.vocab_size) == (built.eod, built.vocab_size) \
        == (vocab, vocab + 1)
    text = f"0 {vocab - 1} {vocab}"
    assert ours.tokenize(text) == theirs.text_to_ids(text) == built.tokenize(text)


def _preprocess(tmp_path, lines, vocab, *extra):
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    return cli.main(["preprocess", "--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "out"),
                     "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab), "--no-progress", *extra])


@pytest.mark.parametrize("vocab", [300, 65498, 65499])  # megatron-core's uint16 / int32 boundary is 65500
def test_preprocess_appends_megatron_cores_eod_in_its_dtype(tmp_path, vocab):
    reference = McoreNullTokenizer(vocab)
    lines = ["1 2 3", f"{vocab - 1} 0", f"7 {vocab}"]  # the eod id itself is a token megatron-core accepts
    assert _preprocess(tmp_path, lines, vocab, "--append-eod") == 0
    written = IndexedDataset(str(tmp_path / "out_text_document"))
    assert written.index.dtype == DType.optimal_dtype(reference.vocab_size)
    assert [written[i].tolist() for i in range(len(written))] == [
        reference.text_to_ids(line) + [reference.eod] for line in lines]


def test_preprocess_refuses_an_id_past_the_eod_in_one_line(tmp_path, capsys):
    assert _preprocess(tmp_path, ["1 2", "3 11"], 10) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert "'3 11' is outside [0, 10] (--vocab-size 10: ids 0..9 and the eod 10)" in err[0], err


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """`train --tokenizer-type NullTokenizer --vocab-size 384` (a fresh GPT-2 from the model flags): 385
    ids, which Megatron-LM pads to 512 (384 would need no padding)."""
    root = make_workspace(tmp_path_factory.mktemp("null_tokenizer"), documents=60)
    code, _, err = cli_inprocess(*base_args(root, 2, *SHAPE, "--tokenizer-type", "NullTokenizer", "--vocab-size", 384,
                                            "--save", root / "run", "--no-checkpoint-checksums", config=False))
    assert code == 0, err[-3000:]
    return root


def test_train_model_vocabulary_and_args_are_megatron_lms(trained):
    tokenizer = McoreNullTokenizer(384)
    divisible = 128  # Megatron-LM's --make-vocab-size-divisible-by default, times tp = 1
    padded = -(-tokenizer.vocab_size // divisible) * divisible  # Megatron-LM's _vocab_size_with_padding
    payload = safe_load(trained / "run" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt")
    args = payload["args"]
    assert (args.tokenizer_type, args.vocab_size, args.padded_vocab_size) == ("NullTokenizer", 384, padded) \
        and padded == 512
    assert args.hf_config["vocab_size"] == tokenizer.vocab_size
    assert payload["model"]["embedding.word_embeddings.weight"].shape[0] == padded


def test_conversion_of_megatron_lm_args_keeps_the_eod_row(trained, tmp_path):
    """A checkpoint with Megatron-LM's args alone (no hf_config): --vocab-size N of a NullTokenizer run
    is N + 1 ids, so megatron-to-hf keeps row N (the eod) and drops only the padding."""
    rank_file = trained / "run" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    payload = safe_load(rank_file)
    del payload["args"].hf_config
    torch.save(payload, rank_file)
    assert cli.main(["convert", "megatron-to-hf", "--megatron", str(trained / "run"), "--out", str(tmp_path / "hf")]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["vocab_size"] == McoreNullTokenizer(384).vocab_size
    from safetensors.torch import load_file
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    embedding = payload["model"]["embedding.word_embeddings.weight"]
    assert torch.equal(weights["transformer.wte.weight"], embedding[:385])


def test_args_vocab_size_of_a_null_tokenizer_checkpoint_is_its_vocab_size_flag(tmp_path):
    """What a NullTokenizer checkpoint's args.vocab_size says is Megatron-LM's --vocab-size (the model's
    vocabulary - 1); the model's own vocabulary, which hf_megatron wrote there before, still reads."""
    from hf_megatron.checkpoint.args import Layout, build_args, config_from_args
    from hf_megatron.config import ModelConfig
    from tiny import VOCAB, tiny_config

    config = ModelConfig.from_hf(tiny_config("gpt2"))
    assert build_args(config, Layout()).vocab_size == VOCAB - 1 == McoreNullTokenizer(VOCAB - 1).eod
    assert build_args(config, Layout(tokenizer={"tokenizer_type": "HuggingFaceTokenizer"})).vocab_size == VOCAB
    for stored in (VOCAB - 1, VOCAB):
        assert config_from_args(build_args(config, Layout(), vocab_size=stored)).vocab_size == VOCAB
    with pytest.raises(Exception, match=rf"args.vocab_size={VOCAB + 1} contradicts args.hf_config, which makes it "
                                        rf"{VOCAB - 1}"):
        config_from_args(build_args(config, Layout(), vocab_size=VOCAB + 1))


def test_train_with_an_hf_config_takes_the_null_tokenizers_vocab_size(tmp_path):
    """With --hf-config giving the model, --vocab-size N is the NullTokenizer's (Megatron-LM's meaning), not a
    model flag: accepted when its N + 1 ids fit the config's vocab_size (here N + 1 == VOCAB), which stays the
    model's vocabulary."""
    from tiny import VOCAB

    root = make_workspace(tmp_path, documents=60)  # token ids 1..VOCAB - 1
    code, out, err = cli_inprocess(*base_args(root, 1, "--tokenizer-type", "NullTokenizer", "--vocab-size", VOCAB - 1,
                                              "--save", root / "run", "--no-checkpoint-checksums"))
    assert code == 0, err[-3000:]
    assert re.search(rf"\n  vocab_size \.+ {VOCAB - 1}\n", out), out  # printed with the arguments
    payload = safe_load(root / "run" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt")
    assert (payload["args"].tokenizer_type, payload["args"].vocab_size) == ("NullTokenizer", VOCAB - 1)
    assert payload["args"].hf_config["vocab_size"] == VOCAB


@pytest.mark.parametrize("source", ["--hf-config", "--hf-model"])
def test_train_refuses_a_null_tokenizer_larger_than_the_models_vocabulary_in_one_line(tmp_path, source):
    from tiny import VOCAB, tiny_hf_model
    from train_cli import error_line

    root = make_workspace(tmp_path, documents=60)
    if source == "--hf-model":
        tiny_hf_model("llama").save_pretrained(root / "config")
    line = error_line(cli_inprocess(*base_args(root, 1, source, root / "config", "--tokenizer-type", "NullTokenizer",
                                               "--vocab-size", VOCAB, config=False)))
    assert line.endswith(f"--vocab-size {VOCAB}: --tokenizer-type NullTokenizer's ids 0..{VOCAB} (eod {VOCAB}) do not "
                         f"fit the model's vocab_size {VOCAB} ({source} {root / 'config'}); expected --vocab-size at "
                         f"most {VOCAB - 1}"), line


def test_vocab_size_with_an_hf_config_is_still_a_model_flag_without_null_tokenizer(tmp_path):
    from tiny import VOCAB
    from train_cli import error_line

    root = make_workspace(tmp_path, documents=60)
    line = error_line(cli_inprocess(*base_args(root, 1, "--vocab-size", VOCAB - 1)))
    assert "the model flags --vocab-size need --num-layers, --hidden-size, --num-attention-heads" in line, line

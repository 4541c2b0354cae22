"""--tokenizer-type GPT2BPETokenizer with a vocab.json lacking '<|endoftext|>': Megatron-LM's
GPT2BPETokenizer takes its end-of-document id from encoder['<|endoftext|>'] and fails (KeyError);
transformers' GPT2TokenizerFast silently appends the token past the vocab. `preprocess` and `train`
refuse it with one line naming the vocab file."""
import json

import numpy as np
import pytest

from hf_megatron import cli
from train_cli import base_args, cli_inprocess, make_workspace


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    root = tmp_path_factory.mktemp("gpt2_eod")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(["alpha beta gamma delta"] * 20, trainers.BpeTrainer(
        vocab_size=270, special_tokens=[], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.model.save(str(root))  # vocab.json + merges.txt, no <|endoftext|>
    vocab, merges = root / "vocab.json", root / "merges.txt"
    assert "<|endoftext|>" not in json.loads(vocab.read_text())
    (root / "in.jsonl").write_text(json.dumps({"text": "alpha beta"}) + "\n")
    make_workspace(root)
    return root, vocab, merges


def _expected(vocab):
    return (f"{vocab}: expected a GPT-2 vocab.json holding '<|endoftext|>' (GPT2BPETokenizer's end-of-document "
            "token); use --tokenizer-type HuggingFaceTokenizer for another vocab")


def test_preprocess_refuses_a_vocab_without_endoftext(files, tmp_path, capsys):
    root, vocab, merges = files
    code = cli.main(["preprocess", "--input", str(root / "in.jsonl"), "--output-prefix", str(tmp_path / "out"),
                     "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab), "--merge-file", str(merges),
                     "--append-eod", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err == f"hf-megatron preprocess: error: {_expected(vocab)}\n", err
    assert not list(tmp_path.iterdir())  # nothing written


def test_train_refuses_a_vocab_without_endoftext(files, tmp_path):
    root, vocab, merges = files
    code, out, err = cli_inprocess(*base_args(root, 1, "--num-layers", 2, "--hidden-size", 64,
                                              "--num-attention-heads", 4, "--tokenizer-type", "GPT2BPETokenizer",
                                              "--vocab-file", vocab, "--merge-file", merges,
                                              "--save", tmp_path / "ckpt", config=False))
    assert code == 2 and err.strip().splitlines()[-1] == f"hf-megatron train: error: {_expected(vocab)}", err[-2000:]
    assert "Traceback" not in err and not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("flag", ["--split-sentences", "--keep-newlines", "--lang=english"])
def test_preprocess_names_megatron_lms_sentence_splitting_flags_as_unsupported(files, tmp_path, capsys, flag):
    """Megatron-LM's tools/preprocess_data.py flags hf-megatron lacks were a bare "unrecognized"."""
    root, _, _ = files
    with pytest.raises(SystemExit) as exit_:
        cli.main(["preprocess", "--input", str(root / "in.jsonl"), "--output-prefix", str(tmp_path / "o"),
                  "--tokenizer-type", "NullTokenizer", "--vocab-size", "10", flag])
    code = exit_.value.code
    err = capsys.readouterr().err.strip().splitlines()[-1]
    name = flag.split("=")[0]
    assert code == 2 and err == (f"hf-megatron preprocess: error: unrecognized arguments: {flag} (Megatron-LM's "
                                 f"{name} is not supported by hf-megatron)"), err
    assert not list(tmp_path.iterdir())

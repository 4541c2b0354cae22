"""The tokenizer travels: `hf-megatron train` from an HF folder stores its tokenizer in
`<save>/tokenizer` (named in the checkpoint's Megatron args), and `convert megatron-to-hf` of the
training folder gives an HF folder whose tokenizer transformers loads and that encodes as the
original; a tokenizer bigger than the model's vocabulary is refused before training."""
import pytest
from transformers import AutoTokenizer

from hf_megatron import cli
from hf_megatron.checkpoint.unpickle import safe_load
from test_convert_helpers import make_tokenizer
from tiny import tiny_config
from train_cli import base_args, cli_inprocess, last_line, make_workspace


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = make_workspace(tmp_path_factory.mktemp("train_tokenizer"), documents=60)
    make_tokenizer(root / "config")  # 280 ids, below the tiny model's 300
    return root


def test_tokenizer_goes_into_the_checkpoint_and_back_to_hf(workspace, capsys):
    code, out, err = cli_inprocess(*base_args(workspace, 2, "--save", workspace / "run"))
    assert code == 0, err
    stored = workspace / "run" / "tokenizer"
    assert (stored / "tokenizer.json").is_file()
    args = safe_load(workspace / "run" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt")["args"]
    assert args.tokenizer_type == "HuggingFaceTokenizer" and args.tokenizer_model == str(stored.absolute())
    assert cli.main(["convert", "megatron-to-hf", "--megatron", str(workspace / "run"),
                     "--out", str(workspace / "hf_out")]) == 0
    original = AutoTokenizer.from_pretrained(workspace / "config")
    converted = AutoTokenizer.from_pretrained(workspace / "hf_out")
    text = "the quick brown fox"
    assert converted(text)["input_ids"] == original(text)["input_ids"]


def test_tokenizer_larger_than_the_vocabulary_is_refused(workspace, tmp_path):
    folder = tmp_path / "small_vocab"
    tiny_config("llama", vocab_size=200).save_pretrained(folder)
    make_tokenizer(folder)  # 280 ids > 200 rows
    args = base_args(workspace, 1, config=False)
    code, out, err = cli_inprocess("--hf-config", folder, *args)
    assert code == 2 and "the tokenizer produces ids up to 279" in last_line(err) and "200 rows" in last_line(err)


def test_hf_to_megatron_carries_a_given_tokenizer_and_leaves_no_empty_folder(workspace, tmp_path):
    from tiny import tiny_hf_model
    hf = tmp_path / "hf"
    tiny_hf_model("llama").save_pretrained(hf)  # weights, no tokenizer files
    assert cli.main(["convert", "hf-to-megatron", "--hf", str(hf), "--out", str(tmp_path / "bare")]) == 0
    assert not (tmp_path / "bare" / "tokenizer").exists()
    assert cli.main(["convert", "hf-to-megatron", "--hf", str(hf), "--out", str(tmp_path / "with"),
                     "--tokenizer", str(workspace / "config")]) == 0
    assert (tmp_path / "with" / "tokenizer" / "tokenizer.json").is_file()
    assert cli.main(["reshard", "--src", str(tmp_path / "with"), "--out", str(tmp_path / "tp2"), "--tp", "2"]) == 0
    text = "a lazy dog"
    assert AutoTokenizer.from_pretrained(tmp_path / "tp2" / "tokenizer")(text)["input_ids"] == \
        AutoTokenizer.from_pretrained(workspace / "config")(text)["input_ids"]


def test_megatron_lm_tokenizer_flags_gpt2_bpe_files_and_null(workspace, tmp_path):
    """--tokenizer-type GPT2BPETokenizer --vocab-file --merge-file (Megatron-LM's GPT-2 files) is the
    run's tokenizer: it gives the model flags their vocabulary and is stored as a transformers folder
    that encodes as transformers' own GPT2TokenizerFast of those files; NullTokenizer stores none."""
    import json
    from transformers import GPT2TokenizerFast
    fast = AutoTokenizer.from_pretrained(workspace / "config")
    fast.backend_tokenizer.model.save(str(tmp_path), "gpt2")  # gpt2-vocab.json, gpt2-merges.txt
    vocab, merges = tmp_path / "gpt2-vocab.json", tmp_path / "gpt2-merges.txt"
    entries = json.loads(vocab.read_text())  # GPT2BPETokenizer's EOD is '<|endoftext|>' of vocab.json
    entries.setdefault("<|endoftext|>", len(entries))
    vocab.write_text(json.dumps(entries))
    ids = len(json.loads(vocab.read_text()))
    import numpy as np
    from hf_megatron.data import IndexedDatasetWriter
    corpus = tmp_path / "corpus_text_document"  # ids this tokenizer has (the workspace's go up to 299)
    with IndexedDatasetWriter(str(corpus), dtype=np.uint16) as writer:
        for doc in np.random.default_rng(0).integers(0, ids, size=(60, 50)):
            writer.add_item(doc)
            writer.end_document()
    shape = ["--num-layers", 2, "--hidden-size", 64, "--num-attention-heads", 4, "--data-path", corpus]
    code, out, err = cli_inprocess(*base_args(workspace, 2, *shape, "--tokenizer-type", "GPT2BPETokenizer",
                                              "--vocab-file", vocab, "--merge-file", merges,
                                              "--save", tmp_path / "bpe", config=False))
    assert code == 0, err[-2000:]
    args = safe_load(tmp_path / "bpe" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt")["args"]
    reference = GPT2TokenizerFast(str(vocab), str(merges))  # adds <|endoftext|> when vocab.json lacks it
    assert args.hf_config["vocab_size"] == len(reference) >= ids
    stored = AutoTokenizer.from_pretrained(tmp_path / "bpe" / "tokenizer")
    text = "the quick brown fox"
    assert stored(text)["input_ids"] == reference(text)["input_ids"] and reference(text)["input_ids"]
    code, out, err = cli_inprocess(*base_args(workspace, 2, *shape, "--tokenizer-type", "NullTokenizer",
                                              "--vocab-size", 300, "--save", tmp_path / "null", config=False))
    assert code == 0, err[-2000:]
    assert not (tmp_path / "null" / "tokenizer").exists()


@pytest.mark.parametrize("argv, fragment", [
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json"], "expected --vocab-file and --merge-file"),
    (["--vocab-file", "v.json", "--merge-file", "m.txt"], "--vocab-file is read with --tokenizer-type "
                                                          "GPT2BPETokenizer"),
    (["--tokenizer-type", "HuggingFaceTokenizer"], "expected a tokenizer for --tokenizer-type HuggingFaceTokenizer"),
    (["--tokenizer-type", "NullTokenizer", "--tokenizer-model", "x"], "NullTokenizer has no tokenizer"),
    (["--tokenizer-type", "BertWordPieceLowerCase"], "--tokenizer-type"),
])
def test_bad_tokenizer_flags_are_one_line(workspace, tmp_path, argv, fragment):
    code, _, err = cli_inprocess(*base_args(workspace, 1, *argv, "--save", tmp_path / "s"))
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-2000:]
    assert fragment in last_line(err), err


def _sentencepiece_model(tmp_path) -> tuple[str, int]:
    """A small SentencePiece model trained by sentencepiece itself on text that ships with Python."""
    import inspect
    import sentencepiece
    import textwrap
    text = [line for module in (textwrap, inspect) for line in inspect.getsource(module).splitlines() if line.strip()]
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(text), model_prefix=str(tmp_path / "sp"),
                                             vocab_size=400, model_type="bpe", minloglevel=2)
    return str(tmp_path / "sp.model"), sentencepiece.SentencePieceProcessor(
        model_file=str(tmp_path / "sp.model")).get_piece_size()


def test_sentencepiece_model_file_gives_the_vocabulary_and_travels_with_its_kind(workspace, tmp_path):
    """--tokenizer-type Llama2Tokenizer --tokenizer-model x.model (Megatron-LM's SentencePiece kinds)
    sizes the model flags' vocabulary as Megatron-LM does (the model's pieces), is stored as
    <save>/tokenizer/tokenizer.model, named in args with its kind -- also after a resume that does not
    repeat --tokenizer-type -- and the stored model encodes as the original."""
    import filecmp
    import sentencepiece
    model, pieces = _sentencepiece_model(tmp_path)
    import numpy as np
    from hf_megatron.data import IndexedDatasetWriter
    corpus = tmp_path / "corpus_text_document"
    with IndexedDatasetWriter(str(corpus), dtype=np.uint16) as writer:
        for doc in np.random.default_rng(0).integers(0, pieces, size=(60, 50)):
            writer.add_item(doc)
            writer.end_document()
    shape = ["--num-layers", 2, "--hidden-size", 64, "--num-attention-heads", 4, "--data-path", corpus,
             "--save", tmp_path / "sp_run"]
    code, out, err = cli_inprocess(*base_args(workspace, 2, *shape, "--tokenizer-type", "Llama2Tokenizer",
                                              "--tokenizer-model", model, config=False))
    assert code == 0, err[-2000:]
    stored = tmp_path / "sp_run" / "tokenizer" / "tokenizer.model"
    assert filecmp.cmp(stored, model, shallow=False)
    args = safe_load(tmp_path / "sp_run" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt")["args"]
    assert args.hf_config["vocab_size"] == pieces
    assert args.tokenizer_type == "Llama2Tokenizer" and args.tokenizer_model == str(stored.absolute())
    text = "the quick brown fox jumps over the lazy dog"
    assert sentencepiece.SentencePieceProcessor(model_file=args.tokenizer_model).encode(text) == \
        sentencepiece.SentencePieceProcessor(model_file=model).encode(text)
    code, out, err = cli_inprocess(*base_args(workspace, 3, "--data-path", corpus, "--load", tmp_path / "sp_run",
                                              "--save", tmp_path / "sp_run", "--use-checkpoint-opt_param-scheduler",
                                              config=False))
    assert code == 0, err[-2000:]
    args = safe_load(tmp_path / "sp_run" / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt")["args"]
    assert args.tokenizer_type == "Llama2Tokenizer" and args.tokenizer_model == str(stored.absolute())


@pytest.mark.parametrize("case", ["sp-kind-with-folder", "hf-kind-with-file", "missing-path", "damaged-model",
                                  "folder-without-tokenizer"])
def test_bad_tokenizer_model_is_one_line(workspace, tmp_path, case):
    damaged = tmp_path / "damaged.model"
    damaged.write_bytes(b"not a sentencepiece model")
    (tmp_path / "empty").mkdir()
    argv = {"sp-kind-with-folder": ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", workspace / "config"],
            "hf-kind-with-file": ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", damaged],
            "missing-path": ["--tokenizer-model", tmp_path / "nope"],
            "damaged-model": ["--tokenizer-model", damaged],
            "folder-without-tokenizer": ["--tokenizer-model", tmp_path / "empty"]}[case]
    fragment = {"sp-kind-with-folder": "reads a SentencePiece .model file",
                "hf-kind-with-file": "reads a tokenizer folder or Hub id",
                "missing-path": "no such file or folder",
                "damaged-model": "not a SentencePiece model",
                "folder-without-tokenizer": "has no tokenizer files"}[case]
    code, _, err = cli_inprocess(*base_args(workspace, 1, *argv, "--save", tmp_path / "s"))
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-2000:]
    assert fragment in last_line(err), err
    assert not (tmp_path / "s" / "latest_checkpointed_iteration.txt").exists()

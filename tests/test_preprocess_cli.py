"""`hf-megatron preprocess`: run as a command, output read back by megatron-core's reader and
compared with the tokenizer's own ids (tiny tokenizers trained here, no network)."""
import json
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest

from data_oracle import IndexedDataset as McoreIndexed
from hf_megatron import cli

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi pi rho".split()


def _documents(count, seed=0):
    rng = random.Random(seed)
    docs = []
    for i in range(count):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 30)))
        if i % 7 == 3:
            text += " café ünïcode\tTAB"
        docs.append({"text": text, "title": rng.choice(WORDS).upper(), "id": i})
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A JSONL corpus and a byte-level BPE trained on it with the `tokenizers` library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("preprocess")
    docs = _documents(300)
    with open(root / "corpus.jsonl", "w") as out:
        for doc in docs:
            out.write(json.dumps(doc) + "\n")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([d["text"] + " " + d["title"] for d in docs], trainer)
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(root / "tok")
    os.makedirs(root / "gpt2", exist_ok=True)
    bpe.model.save(str(root / "gpt2"))  # vocab.json + merges.txt
    return root, docs


def _expected(texts, encode, eod):
    out = []
    for text in texts:
        ids = list(encode(text))
        out.append(ids + [eod] if ids else [])
    return out


def _read_documents(prefix):
    reader = McoreIndexed(prefix)  # megatron-core's reader is the judge of the format
    ends = reader.document_indices
    docs = [np.concatenate([reader[i] for i in range(ends[d], ends[d + 1])] or [np.zeros(0, np.int64)]).tolist()
            for d in range(len(ends) - 1)]
    return docs, reader.index.dtype


def test_cli_jsonl_two_keys_workers(corpus, tmp_path):
    from transformers import AutoTokenizer

    root, docs = corpus
    prefix = str(tmp_path / "out" / "corpus")
    command = [sys.executable, "-m", "hf_megatron.cli", "preprocess", "--input", str(root / "corpus.jsonl"),
               "--output-prefix", prefix, "--json-keys", "text", "title", "--tokenizer-type",
               "HuggingFaceTokenizer", "--tokenizer-model", str(root / "tok"), "--append-eod",
               "--workers", "2", "--partitions", "3"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "docs/s" in done.stderr and "MB/s" in done.stderr
    tokenizer = AutoTokenizer.from_pretrained(root / "tok")
    encode = lambda text: tokenizer(text).input_ids  # noqa: E731
    for key in ("text", "title"):
        got, dtype = _read_documents(f"{prefix}_{key}_document")
        assert dtype == np.uint16
        assert got == _expected([d[key] for d in docs], encode, tokenizer.eos_token_id)
    assert not [p for p in os.listdir(tmp_path / "out") if "tmp" in p]  # no leftovers


def test_workers_and_partitions_do_not_change_output(corpus, tmp_path):
    root, _ = corpus
    base = ["preprocess", "--input", str(root / "corpus.jsonl"), "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", str(root / "tok"), "--append-eod", "--no-progress"]
    assert cli.main(base + ["--output-prefix", str(tmp_path / "a")]) == 0
    assert cli.main(base + ["--output-prefix", str(tmp_path / "b"), "--workers", "2", "--partitions", "5"]) == 0
    for suffix in (".bin", ".idx"):
        assert ((tmp_path / f"a_text_document{suffix}").read_bytes()
                == (tmp_path / f"b_text_document{suffix}").read_bytes())


def test_text_parquet_and_saved_dataset_inputs(corpus, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    root, docs = corpus
    tokenizer = AutoTokenizer.from_pretrained(root / "tok")
    encode = lambda text: tokenizer(text).input_ids  # noqa: E731
    texts = [d["text"] for d in docs if d["text"]]
    (tmp_path / "c.txt").write_text("".join(t + "\n" for t in texts))
    pq.write_table(pa.table({"text": texts}), tmp_path / "c.parquet", row_group_size=64)
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "saved"))
    expected = _expected(texts, encode, tokenizer.eos_token_id)
    for name in ("c.txt", "c.parquet", "saved"):
        prefix = str(tmp_path / f"out_{name}")
        assert cli.main(["preprocess", "--input", str(tmp_path / name), "--output-prefix", prefix,
                         "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(root / "tok"),
                         "--append-eod", "--workers", "1", "--partitions", "3", "--no-progress"]) == 0
        assert _read_documents(prefix + "_text_document")[0] == expected, name


def test_gpt2_vocab_merges_tokenizer(corpus, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    root, docs = corpus
    prefix = str(tmp_path / "g")
    assert cli.main(["preprocess", "--input", str(root / "corpus.jsonl"), "--output-prefix", prefix,
                     "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(root / "gpt2" / "vocab.json"),
                     "--merge-file", str(root / "gpt2" / "merges.txt"), "--append-eod", "--no-progress"]) == 0
    # the files loaded straight into a `tokenizers` byte-level BPE as the reference
    reference = Tokenizer(models.BPE.from_file(str(root / "gpt2" / "vocab.json"), str(root / "gpt2" / "merges.txt")))
    reference.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    eod = reference.token_to_id("<|endoftext|>")
    expected = _expected([d["text"] for d in docs], lambda t: reference.encode(t).ids, eod)
    assert _read_documents(prefix + "_text_document")[0] == expected


def test_sentencepiece_trained_by_cli(corpus, tmp_path):
    import sentencepiece

    root, docs = corpus
    model = str(tmp_path / "sp" / "tiny.model")
    prefix = str(tmp_path / "s")
    assert cli.main(["preprocess", "--input", str(root / "corpus.jsonl"), "--output-prefix", prefix,
                     "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model,
                     "--train-tokenizer", "sentencepiece", "--vocab-size", "60", "--append-eod",
                     "--no-progress"]) == 0
    processor = sentencepiece.SentencePieceProcessor(model_file=model)
    expected = _expected([d["text"] for d in docs], processor.encode, processor.eos_id())
    assert _read_documents(prefix + "_text_document")[0] == expected


def test_bpe_trained_by_cli_loads_with_transformers(corpus, tmp_path):
    from transformers import AutoTokenizer

    root, docs = corpus
    tok_dir, prefix = str(tmp_path / "newtok"), str(tmp_path / "n")
    assert cli.main(["preprocess", "--input", str(root / "corpus.jsonl"), "--output-prefix", prefix,
                     "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tok_dir,
                     "--train-tokenizer", "bpe", "--vocab-size", "300", "--no-progress"]) == 0
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    assert 250 < len(tokenizer) <= 300
    expected = [tokenizer(d["text"]).input_ids for d in docs]
    assert _read_documents(prefix + "_text_document")[0] == expected


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_blank_lines_are_skipped_with_a_warning(corpus, tmp_path, capsys, suffix):
    """A blank (whitespace-only) line holds no document: it is skipped as datasets' json loader
    (pyarrow.json) skips it -- Megatron-LM's preprocess_data.py fails on it -- and said in one
    warning line per file, with the count and the first line (they were dropped without a word).
    A file's final newline is no blank line: the plain corpus gives no warning."""
    import gzip

    import pyarrow.json

    root, docs = corpus
    lines = (root / "corpus.jsonl").read_text().splitlines(keepends=True)
    blanky = "".join(lines[:4] + ["\n"] + lines[4:150] + ["  \t\r\n"] + lines[150:] + ["\n"])  # lines 5, 152, 304
    path = tmp_path / f"blanky{suffix}"
    path.write_bytes(gzip.compress(blanky.encode()) if suffix.endswith(".gz") else blanky.encode())
    assert pyarrow.json.read_json(path).to_pylist() == docs  # the reader `datasets` uses skips them
    base = ["preprocess", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(root / "tok"),
            "--append-eod", "--no-progress", "--workers", "2", "--partitions", "3"]
    assert cli.main(base + ["--input", str(root / "corpus.jsonl"), "--output-prefix", str(tmp_path / "a")]) == 0
    assert "warning" not in capsys.readouterr().err
    assert cli.main(base + ["--input", str(path), "--output-prefix", str(tmp_path / "b")]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == [f"hf-megatron preprocess: warning: {path}: skipped 3 blank lines (whitespace only, "
                        "no document), the first at line 5"]
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"a_text_document{ext}").read_bytes() == (tmp_path / f"b_text_document{ext}").read_bytes()


@pytest.mark.parametrize("case", ["missing_input", "bad_json", "missing_key", "missing_vocab", "bad_format"])
def test_bad_inputs_give_one_line_errors(corpus, tmp_path, capsys, case):
    root, _ = corpus
    source = str(root / "corpus.jsonl")
    extra, needle = [], None
    if case == "missing_input":
        source, needle = str(tmp_path / "nope.jsonl"), "nope.jsonl: input not found"
    elif case == "bad_json":
        (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": broken\n')
        source, needle = str(tmp_path / "bad.jsonl"), "bad.jsonl:2: invalid JSON"
    elif case == "missing_key":
        extra, needle = ["--json-keys", "body"], "corpus.jsonl:1: no field 'body'"
    elif case == "missing_vocab":
        extra, needle = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tmp_path / "v.json"),
                         "--merge-file", "m.txt"], "v.json: GPT-2 vocab.json not found"
    else:
        (tmp_path / "x.csv").write_text("a,b\n")
        source, needle = str(tmp_path / "x.csv"), "x.csv: unknown input format"
    argv = ["preprocess", "--input", source, "--output-prefix", str(tmp_path / "o"), "--no-progress",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(root / "tok")] + extra
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert needle in err[-1], err
    assert not [p for p in os.listdir(tmp_path) if p.startswith("o")]  # nothing half-written


@pytest.mark.parametrize("case", ["repeated_key", "file_on_the_output_path"])
def test_unusable_keys_and_output_paths_are_one_line_before_anything_is_written(corpus, tmp_path, capsys, case):
    """--json-keys text text wrote the corpus twice into one file; an --output-prefix under a file was
    a NotADirectoryError traceback."""
    root, _ = corpus
    source = root / "corpus.jsonl"
    prefix, keys = tmp_path / "o", ["text"]
    if case == "repeated_key":
        keys = ["text", "text"]
        expected = "--json-keys text text: expected each key once, got 'text' more than once"
    else:
        prefix = tmp_path / "corpus.jsonl" / "sub" / "o"
        (tmp_path / "corpus.jsonl").write_text("")
        expected = f"--output-prefix {prefix}: expected a folder path, {tmp_path / 'corpus.jsonl'} is a file"
    argv = ["preprocess", "--input", str(source), "--output-prefix", str(prefix), "--json-keys", *keys,
            "--no-progress", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(root / "tok")]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == f"hf-megatron preprocess: error: {expected}\n"
    assert sorted(os.listdir(tmp_path)) == (["corpus.jsonl"] if case != "repeated_key" else [])


def test_train_tokenizer_refuses_to_overwrite_and_too_small_vocabularies(corpus, tmp_path, capsys):
    """--train-tokenizer overwrote an existing tokenizer silently; bpe --vocab-size 5 silently gave 257
    entries; a SentencePiece vocabulary below the corpus's characters was a RuntimeError traceback."""
    root, _ = corpus

    def run(kind, model, size):
        tokenizer_type = "HuggingFaceTokenizer" if kind == "bpe" else "SentencePieceTokenizer"
        code = cli.main(["preprocess", "--input", str(root / "corpus.jsonl"), "--output-prefix", str(tmp_path / "o"),
                         "--tokenizer-type", tokenizer_type, "--tokenizer-model", str(model), "--train-tokenizer",
                         kind, "--vocab-size", str(size), "--no-progress"])
        return code, capsys.readouterr().err

    code, err = run("bpe", tmp_path / "t", 5)
    assert code == 2 and err == ("hf-megatron preprocess: error: --vocab-size 5: expected at least 257 for "
                                 "--train-tokenizer bpe (a byte-level BPE holds the 256 byte tokens and "
                                 "<|endoftext|>)\n")
    existing = tmp_path / "tok"
    shutil.copytree(root / "tok", existing)
    before = {p.name: p.read_bytes() for p in existing.iterdir()}
    code, err = run("bpe", existing, 300)
    assert code == 2 and err.startswith(f"hf-megatron preprocess: error: --tokenizer-model {existing}: {existing} "
                                        "already exists and --train-tokenizer would overwrite it")
    assert {p.name: p.read_bytes() for p in existing.iterdir()} == before
    (tmp_path / "sp.model").write_bytes(b"kept")
    code, err = run("sentencepiece", tmp_path / "sp.model", 300)
    assert code == 2 and "already exists" in err and (tmp_path / "sp.model").read_bytes() == b"kept"
    code, err = run("sentencepiece", tmp_path / "small.model", 5)
    assert code == 2 and err.startswith("hf-megatron preprocess: error: --vocab-size 5: SentencePiece cannot train "
                                        "it (Vocabulary size is smaller than required_chars") and err.count("\n") == 1
    assert not [p for p in os.listdir(tmp_path) if p.startswith("o")]

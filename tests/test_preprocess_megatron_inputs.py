"""Inputs Megatron-LM's tools/preprocess_data.py reads that hf-megatron preprocess refused or ignored:
gzip-compressed JSON lines, a list of strings under a --json-keys key, --log-interval N."""
import gzip
import json

from hf_megatron import cli
from test_preprocess_cli import _read_documents, corpus  # noqa: F401  (the module fixture)


def _argv(root, source, prefix, *extra):
    return ["preprocess", "--input", str(source), "--output-prefix", str(prefix), "--tokenizer-type",
            "HuggingFaceTokenizer", "--tokenizer-model", str(root / "tok"), "--append-eod", *extra]


def test_gzip_jsonl_gives_the_same_output_as_the_plain_file(corpus, tmp_path):  # noqa: F811
    root, _ = corpus
    plain = (root / "corpus.jsonl").read_bytes()
    for name in ("c.jsonl.gz", "c.json.gz"):
        (tmp_path / name).write_bytes(gzip.compress(plain))
    assert cli.main(_argv(root, root / "corpus.jsonl", tmp_path / "a", "--no-progress")) == 0
    assert cli.main(_argv(root, tmp_path / "c.jsonl.gz", tmp_path / "b", "--no-progress", "--workers", "2")) == 0
    assert cli.main(_argv(root, tmp_path / "c.json.gz", tmp_path / "c", "--no-progress")) == 0
    for suffix in (".bin", ".idx"):
        expected = (tmp_path / f"a_text_document{suffix}").read_bytes()
        assert (tmp_path / f"b_text_document{suffix}").read_bytes() == expected
        assert (tmp_path / f"c_text_document{suffix}").read_bytes() == expected


def test_corrupt_gzip_is_one_line(corpus, tmp_path, capsys):  # noqa: F811
    root, _ = corpus
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip at all\n")
    assert cli.main(_argv(root, tmp_path / "bad.jsonl.gz", tmp_path / "o", "--no-progress")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.jsonl.gz: cannot read gzip input" in err[0], err
    assert not list(tmp_path.glob("o*"))


def test_a_list_of_strings_is_one_document_of_sentences_as_megatron_lm_encodes_it(corpus, tmp_path):  # noqa: F811
    """Megatron-LM's Encoder.encode: each element tokenised alone, empty ones dropped, concatenated;
    one sequence per element, the eod on the last one."""
    from data_oracle import IndexedDataset as McoreIndexed
    from transformers import AutoTokenizer

    root, _ = corpus
    values = [["alpha beta", "", "gamma delta"], "eta theta", [], ["iota"], [""]]
    (tmp_path / "l.jsonl").write_text("".join(json.dumps({"text": v}) + "\n" for v in values))
    assert cli.main(_argv(root, tmp_path / "l.jsonl", tmp_path / "o", "--no-progress")) == 0
    tokenizer = AutoTokenizer.from_pretrained(root / "tok")
    eod, encode = tokenizer.eos_token_id, lambda text: tokenizer(text).input_ids  # noqa: E731
    sentences = [[encode(t) for t in (v if isinstance(v, list) else [v]) if encode(t)] for v in values]
    for parts in sentences:
        if parts:
            parts[-1] = parts[-1] + [eod]
    reader = McoreIndexed(str(tmp_path / "o_text_document"))
    assert reader.document_indices.tolist() == [0, 2, 3, 3, 4, 4]
    assert [reader[i].tolist() for i in range(len(reader))] == [s for parts in sentences for s in parts]
    assert _read_documents(str(tmp_path / "o_text_document"))[0] == [sum(p, []) for p in sentences]


def test_a_list_of_non_strings_is_one_line(corpus, tmp_path, capsys):  # noqa: F811
    root, _ = corpus
    (tmp_path / "n.jsonl").write_text('{"text": ["a", 5]}\n')
    assert cli.main(_argv(root, tmp_path / "n.jsonl", tmp_path / "o", "--no-progress")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "expected a string or a list of strings" in err[0], err


def test_log_interval_prints_megatron_lm_progress_lines_every_n_documents(corpus, tmp_path, capsys):  # noqa: F811
    """Megatron-LM's print_processing_stats: 'Processed N documents (x docs/s, y MB/s).' on stderr at
    each multiple of N, in place of the bar (also with --no-progress); the output is unchanged."""
    import re

    root, docs = corpus  # 300 documents
    assert cli.main(_argv(root, root / "corpus.jsonl", tmp_path / "a", "--no-progress")) == 0
    assert "Processed" not in capsys.readouterr().err
    line = re.compile(r"^Processed (\d+) documents \(\d+\.\d\d docs/s, \d+\.\d\d MB/s\)\.$")
    for name, extra in (("b", ["--log-interval", "100"]), ("c", ["--log-interval", "70", "--workers", "2",
                                                                  "--partitions", "3", "--no-progress"])):
        assert cli.main(_argv(root, root / "corpus.jsonl", tmp_path / name, *extra)) == 0
        err = capsys.readouterr().err.splitlines()
        counts = [int(m.group(1)) for m in map(line.match, err) if m]
        step = int(extra[1])
        assert counts == list(range(step, len(docs) + 1, step)), err
        assert len(err) == len(counts) + 1 and "docs/s" in err[-1], err  # no bar, then the summary
        for suffix in (".bin", ".idx"):
            assert ((tmp_path / f"{name}_text_document{suffix}").read_bytes()
                    == (tmp_path / f"a_text_document{suffix}").read_bytes())
    assert cli.main(_argv(root, root / "corpus.jsonl", tmp_path / "d", "--log-interval", "0")) == 2
    assert capsys.readouterr().err.strip().endswith("--log-interval 0: expected a number of documents >= 1")

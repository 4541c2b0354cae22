"""`hf-megatron preprocess` from `datasets.load_dataset` inputs, offline (HF_DATASETS_OFFLINE=1,
a private cache): a local folder of JSON-lines shards, a parquet file, a save_to_disk folder,
streaming, several workers -- each output byte-identical to the plain JSONL path; the JSONL
path itself matches the transformers tokenizer's own ids (read back by megatron-core)."""
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from data_oracle import IndexedDataset as McoreIndexed
from hf_megatron import cli

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa café ünï".split()
DRIVER = ("import json, sys\nfrom hf_megatron import cli\n"
          "print(json.dumps([cli.main(argv) for argv in json.loads(sys.argv[1])]))")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Three JSON-lines shards in a folder, the same rows as parquet and save_to_disk, a tokenizer."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hf_megatron.data import train_bpe_tokenizer

    root = tmp_path_factory.mktemp("hf_inputs")
    rng = random.Random(0)
    rows = [{"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 25))),
             "prompt": "q " + rng.choice(WORDS), "response": " ".join(rng.choice(WORDS) for _ in range(3))}
            for _ in range(240)]
    os.makedirs(root / "folder")
    for part in range(3):
        with open(root / "folder" / f"part-{part:02d}.jsonl", "w") as out:
            for row in rows[part * 80:(part + 1) * 80]:
                out.write(json.dumps(row) + "\n")
    columns = {k: [r[k] for r in rows] for k in rows[0]}
    pq.write_table(pa.table(columns), root / "rows.parquet", row_group_size=50)
    datasets.Dataset.from_dict(columns).save_to_disk(str(root / "saved"))
    train_bpe_tokenizer([r["text"] for r in rows], 280, str(root / "tok"))
    return root, rows


def _offline_env(root):
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               HF_DATASETS_CACHE=str(root / "hf_cache"), TQDM_DISABLE="1")
    return env


def _base(root, prefix, *extra):
    return ["preprocess", "--output-prefix", str(prefix), "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", str(root / "tok"), "--append-eod", *map(str, extra)]


def _same(a, b):
    return all(open(f"{a}{s}", "rb").read() == open(f"{b}{s}", "rb").read() for s in (".bin", ".idx"))


def test_load_dataset_inputs_give_the_jsonl_bytes(corpus, tmp_path):
    from transformers import AutoTokenizer

    root, rows = corpus
    assert cli.main(_base(root, tmp_path / "jsonl", "--no-progress", "--input", root / "folder" / "part-*.jsonl")) == 0
    tokenizer = AutoTokenizer.from_pretrained(root / "tok")
    reader = McoreIndexed(str(tmp_path / "jsonl_text_document"))
    expected = [tokenizer(r["text"]).input_ids for r in rows]
    assert [reader[i].tolist() for i in range(len(reader))] == [e + [tokenizer.eos_token_id] for e in expected if e]

    # the real command, several workers, with a progress bar, offline
    done = subprocess.run([sys.executable, "-m", "hf_megatron.cli",
                           *_base(root, tmp_path / "folder", "--hf-dataset", root / "folder", "--workers", 2)],
                          capture_output=True, text=True, timeout=300, env=_offline_env(root))
    assert done.returncode == 0, done.stderr[-2000:]
    assert _same(tmp_path / "jsonl_text_document", tmp_path / "folder_text_document")

    variants = {
        "parquet": ["--hf-dataset", root / "rows.parquet", "--workers", 2],
        "stream": ["--input", f"hf://{root / 'folder'}", "--streaming", "--workers", 2],
        "saved": ["--hf-dataset", root / "saved"],
    }
    argvs = [_base(root, tmp_path / name, "--no-progress", *extra) for name, extra in variants.items()]
    # the same SFT records from parquet and from JSON lines
    argvs += [_base(root, tmp_path / f"sft_{name}", "--no-progress", "--sft", "--json-keys", "prompt", "response",
                    *extra) for name, extra in (("jsonl", ["--input", root / "folder" / "part-*.jsonl"]),
                                                ("hub", ["--hf-dataset", root / "rows.parquet"]))]
    done = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(argvs)], capture_output=True, text=True,
                          timeout=300, env=_offline_env(root))
    assert done.returncode == 0 and json.loads(done.stdout.splitlines()[-1]) == [0] * len(argvs), done.stderr[-2000:]
    for name in variants:
        assert _same(tmp_path / "jsonl_text_document", tmp_path / f"{name}_text_document"), name
    for suffix in ("", "_loss_mask"):
        assert _same(tmp_path / f"sft_jsonl_sft_document{suffix}", tmp_path / f"sft_hub_sft_document{suffix}")


def test_bad_hub_inputs_are_one_line_errors(corpus, tmp_path):
    root, _ = corpus
    cases = [
        (["--hf-dataset", tmp_path / "no_such_folder"], "no_such_folder: dataset not found"),
        (["--hf-dataset", root / "rows.parquet", "--hf-split", "validation"], "rows.parquet: load_dataset failed"),
        (["--hf-dataset", root / "rows.parquet", "--json-keys", "body"], "rows.parquet: no column 'body'"),
        (["--hf-dataset", root / "saved", "--streaming"], "--streaming reads data files or Hub datasets"),
        ([], "no input: give --input FILES or --hf-dataset NAME"),
    ]
    argvs = [_base(root, tmp_path / f"o{i}", "--no-progress", *extra) for i, (extra, _) in enumerate(cases)]
    done = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(argvs)], capture_output=True, text=True,
                          timeout=300, env=_offline_env(root))
    assert json.loads(done.stdout.splitlines()[-1]) == [2] * len(cases), done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("hf-megatron preprocess: error:")]
    assert len(errors) == len(cases), done.stderr[-2000:]
    for line, (_, needle) in zip(errors, cases):
        assert needle in line, line
    assert not [p for p in os.listdir(tmp_path) if p.startswith("o")]  # nothing half-written


def test_split_flags_apply_to_their_inputs_or_are_refused(corpus, tmp_path, capsys):
    """A saved DatasetDict: `--input DIR --split validation` and `--hf-dataset DIR --hf-split validation` give
    that split's rows (the transformers tokenizer's ids, read back by megatron-core).  A split flag no input
    takes (`--hf-dataset DIR --split validation`, `--input x.jsonl --hf-split ...`, `--streaming` on files)
    was ignored -- the train rows were written -- and is now one line naming the flag, nothing written."""
    import datasets
    from transformers import AutoTokenizer

    root, rows = corpus
    folder = tmp_path / "dd"
    columns = {"text": [r["text"] for r in rows]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": columns["text"][:200]}),
                          "validation": datasets.Dataset.from_dict({"text": columns["text"][200:]})}
                         ).save_to_disk(str(folder))
    tokenizer = AutoTokenizer.from_pretrained(root / "tok")
    expected = [ids + [tokenizer.eos_token_id] for ids in (tokenizer(t).input_ids for t in columns["text"][200:]) if ids]
    for name, extra in (("input", ["--input", folder, "--split", "validation"]),
                        ("hub", ["--hf-dataset", folder, "--hf-split", "validation"])):
        assert cli.main(_base(root, tmp_path / name, "--no-progress", *extra)) == 0
        reader = McoreIndexed(str(tmp_path / f"{name}_text_document"))
        assert [reader[i].tolist() for i in range(len(reader))] == expected
    capsys.readouterr()
    jsonl = root / "folder" / "part-00.jsonl"
    cases = [(["--hf-dataset", folder, "--split", "validation"], "--split validation: picks the split of a saved "
                                                                 "DatasetDict folder under --input and none is given"),
             (["--input", root / "saved", "--split", "validation"], "--split validation: picks"),
             (["--input", jsonl, "--hf-split", "validation"], "--hf-split validation: applies to --hf-dataset"),
             (["--input", jsonl, "--hf-subset", "en"], "--hf-subset en: applies to"),
             (["--input", jsonl, "--streaming"], "--streaming: applies to")]
    for i, (extra, needle) in enumerate(cases):
        assert cli.main(_base(root, tmp_path / f"bad{i}", "--no-progress", *extra)) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("hf-megatron preprocess: error: ") and needle in err and "\n" not in err, err
    assert not [p for p in os.listdir(tmp_path) if p.startswith("bad")]

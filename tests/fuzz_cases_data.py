"""Fuzz cases for data: .idx/.bin mutations, JSON-lines corpora, tokenizer files (no tests here)."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from fuzz_bases import VOCAB, Bases
from fuzz_harness import Case, cli
from hf_megatron.data import IndexedDataset, build_gpt_datasets
from hf_megatron.data.indexed import HEADER_BYTES, MAGIC

S, D1 = 12, 7  # sequences and document entries of the base dataset
LENGTHS, POINTERS, DOCS = HEADER_BYTES, HEADER_BYTES + 4 * S, HEADER_BYTES + 12 * S


def _open(prefix: str):
    return IndexedDataset(prefix)


def _patch(b: Bases, offset: int, data: bytes, fuzz_bin: bool = False):
    """A case writing `data` at `offset` of the copied .idx (or .bin), then opening it."""
    def run(workdir: Path):
        prefix = b.copy_data(workdir)
        path = Path(prefix + (".bin" if fuzz_bin else ".idx"))
        raw = bytearray(path.read_bytes())
        raw[offset: offset + len(data)] = data
        path.write_bytes(bytes(raw))
        return _open(prefix)
    return run


def _arrays(b: Bases, edit):
    """A case rewriting (lengths, pointers, docs) of the .idx through `edit`, keeping the header's counts."""
    def run(workdir: Path):
        prefix = b.copy_data(workdir)
        path = Path(prefix + ".idx")
        raw = path.read_bytes()
        lengths = np.frombuffer(raw, np.int32, S, LENGTHS).copy()
        pointers = np.frombuffer(raw, np.int64, S, POINTERS).copy()
        docs = np.frombuffer(raw, np.int64, D1, DOCS).copy()
        edit(lengths, pointers, docs)
        path.write_bytes(raw[:HEADER_BYTES] + lengths.tobytes() + pointers.tobytes() + docs.tobytes())
        return _open(prefix)
    return run


def _file_edit(b: Bases, suffix: str, edit):
    def run(workdir: Path):
        prefix = b.copy_data(workdir)
        path = Path(prefix + suffix)
        edit(path)
        return _open(prefix)
    return run


def _negative(i):
    def edit(lengths, pointers, docs):
        lengths[i] = -lengths[i]
        pointers[1:] = np.cumsum(lengths[:-1].astype(np.int64) * 2)  # pointers consistent with the lengths
    return edit


def _pointer(i, delta):
    def edit(lengths, pointers, docs):
        pointers[i] += delta
    return edit


def _vocab(b: Bases, position: int, token: int):
    def run(workdir: Path):
        prefix = b.copy_data(workdir)
        tokens = np.fromfile(prefix + ".bin", np.uint16)
        tokens[position] = token
        tokens.tofile(prefix + ".bin")
        return build_gpt_datasets(prefix, split="1,0,0", seq_length=8, cache_dir=str(workdir / "cache"),
                                  vocab_size=VOCAB)
    return run


def index_cases(b: Bases) -> list[Case]:
    cat = "data .idx/.bin"
    cases = [Case(cat, f"magic byte {i}", _patch(b, i, bytes([MAGIC[i] ^ 0x5A])), ".idx") for i in range(len(MAGIC))]
    cases += [Case(cat, f"version {v}", _patch(b, 9, struct.pack("<Q", v)), "version") for v in (0, 2, 3, 255, 2 ** 63)]
    cases += [Case(cat, f"dtype code {c}", _patch(b, 17, bytes([c])), "dtype code") for c in (0, 9, 10, 200, 255)]
    cases += [Case(cat, f"sequence count {n}", _patch(b, 18, struct.pack("<Q", n)), ".idx")
              for n in (S + 1, S + 1000, 2 ** 40, 2 ** 63, S - 1, 0)]
    cases += [Case(cat, f"document count {n}", _patch(b, 26, struct.pack("<Q", n)), ".idx")
              for n in (0, D1 + 1, 2 ** 50, 1)]
    size = DOCS + 8 * D1
    cases += [Case(cat, f".idx truncated to {n} bytes", _file_edit(b, ".idx", lambda p, n=n: p.write_bytes(p.read_bytes()[:n])),
                   ".idx") for n in (0, 1, 8, 9, 17, 18, 25, 33, HEADER_BYTES, LENGTHS + 5, POINTERS + 9, DOCS + 3, size - 1)]
    cases += [Case(cat, f"negative length of sequence {i}", _arrays(b, _negative(i)), "negative length") for i in range(S)]
    cases += [Case(cat, f"pointer {i} off by {d}", _arrays(b, _pointer(i, d)), ".idx") for i in range(S) for d in (2, -2)]
    cases += [Case(cat, f"length {i} huge", _arrays(b, lambda l, p, d, i=i: l.__setitem__(i, 2 ** 31 - 1)), "corpus")
              for i in (0, 5, S - 1)]
    cases += [Case(cat, "documents backwards", _arrays(b, lambda l, p, d: d.__setitem__(slice(2, 4), d[2:4][::-1])), ".idx"),
              Case(cat, "first document index 1", _arrays(b, lambda l, p, d: d.__setitem__(0, 1)), ".idx"),
              Case(cat, "last document index short", _arrays(b, lambda l, p, d: d.__setitem__(-1, S - 1)), ".idx"),
              Case(cat, "last document index beyond", _arrays(b, lambda l, p, d: d.__setitem__(-1, S + 4)), ".idx"),
              Case(cat, "document index negative", _arrays(b, lambda l, p, d: d.__setitem__(3, -7)), ".idx")]
    for name, edit in [("truncated by 1 byte", lambda p: p.write_bytes(p.read_bytes()[:-1])),
                       ("truncated by 2 bytes", lambda p: p.write_bytes(p.read_bytes()[:-2])),
                       ("truncated to half", lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])),
                       ("empty", lambda p: p.write_bytes(b"")),
                       ("1 byte longer", lambda p: p.write_bytes(p.read_bytes() + b"\0")),
                       ("4 bytes longer", lambda p: p.write_bytes(p.read_bytes() + b"\0" * 4)),
                       ("missing", lambda p: p.unlink()),
                       ("a folder", lambda p: (p.unlink(), p.mkdir()))]:
        cases.append(Case(cat, f".bin {name}", _file_edit(b, ".bin", edit), ".bin"))
    for name, edit in [("missing", lambda p: p.unlink()), ("a folder", lambda p: (p.unlink(), p.mkdir())),
                       ("garbage", lambda p: p.write_bytes(bytes(range(256)) * 3)),
                       ("a text file", lambda p: p.write_text("hello world\n" * 20))]:
        cases.append(Case(cat, f".idx {name}", _file_edit(b, ".idx", edit), ".idx"))
    cases += [Case(cat, f"token id {t} at {pos} (vocab {VOCAB})", _vocab(b, pos, t), "outside the model's vocabulary")
              for t, pos in ((VOCAB, 0), (VOCAB + 1, 100), (65535, 239), (1000, 17))]
    return cases


def _preprocess(b: Bases, workdir: Path, inputs, *extra, tokenizer=None):
    return cli(["preprocess", "--input", *inputs, "--output-prefix", workdir / "out", "--tokenizer-type",
                "HuggingFaceTokenizer", "--tokenizer-model", tokenizer or b.llama, "--no-progress", *extra])


def _jsonl(b: Bases, text: bytes, *extra, name: str = "c.jsonl"):
    def run(workdir: Path):
        path = workdir / name
        path.write_bytes(text)
        return _preprocess(b, workdir, [path], *extra)
    return run


def jsonl_cases(b: Bases) -> list[Case]:
    cat = "data JSON lines"
    good = b'{"text": "hello world"}\n'
    # (a list of strings is no bad input: Megatron-LM's Encoder.encode makes it a document of sentences)
    values = {"null": b"null", "number": b"42", "float": b"1.5", "list of numbers": b'["a", 2]', "object": b'{"a": 1}',
              "true": b"true", "false": b"false"}
    cases = [Case(cat, f'"text": {name}', _jsonl(b, good + b'{"text": ' + v + b"}\n"), "text") for name, v in values.items()]
    bad_lines = {"truncated object": b'{"text": "abc', "bare word": b"hello", "trailing comma": b'{"text": "a",}',
                 "single quotes": b"{'text': 'a'}", "array line": b'["text"]', "string line": b'"text"',
                 "number line": b"17", "null line": b"null", "invalid utf-8": b'{"text": "\xff\xfe"}',
                 "nul bytes": b"\x00\x00\x00", "two objects": b'{"text": "a"}{"text": "b"}'}
    cases += [Case(cat, name, _jsonl(b, good + line + b"\n" + good), "c.jsonl") for name, line in bad_lines.items()]
    cases += [Case(cat, "missing key", _jsonl(b, good + b'{"body": "x"}\n'), "text"),
              Case(cat, "other --json-keys", _jsonl(b, good, "--json-keys", "body"), "body"),
              Case(cat, "empty file", _jsonl(b, b""), "c.jsonl"),
              Case(cat, "only blank lines", _jsonl(b, b"\n\n\n"), "c.jsonl"),
              Case(cat, "unknown extension", _jsonl(b, good, name="c.csv"), "c.csv"),
              Case(cat, "input missing", lambda w: _preprocess(b, w, [w / "nope.jsonl"]), "nope.jsonl"),
              Case(cat, "input is an empty folder", lambda w: (w.joinpath("d").mkdir(), _preprocess(b, w, [w / "d"]))[1],
                   "d")]
    return cases


def _tokenizer(b: Bases, edit, tokenizer_type: str = "HuggingFaceTokenizer", *flags):
    def run(workdir: Path):
        folder = workdir / "tok"
        folder.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (b.llama / name).is_file():
                (folder / name).write_bytes((b.llama / name).read_bytes())
        edit(folder)
        return cli(["preprocess", "--input", b.jsonl, "--output-prefix", workdir / "out", "--tokenizer-type",
                    tokenizer_type, "--tokenizer-model", folder, "--no-progress", *flags])
    return run


def _gpt2_bpe(vocab: bytes, merges: bytes):
    def run(workdir: Path):
        (workdir / "vocab.json").write_bytes(vocab)
        (workdir / "merges.txt").write_bytes(merges)
        return cli(["preprocess", "--input", workdir / "vocab.json", "--output-prefix", workdir / "out",
                    "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", workdir / "vocab.json",
                    "--merge-file", workdir / "merges.txt", "--no-progress"])
    return run


def tokenizer_cases(b: Bases) -> list[Case]:
    cat = "tokenizer files"
    tj = "tokenizer.json"
    edits = {
        "tokenizer.json empty": lambda f: (f / tj).write_text(""),
        "tokenizer.json invalid JSON": lambda f: (f / tj).write_text("{not json"),
        "tokenizer.json truncated": lambda f: (f / tj).write_bytes((f / tj).read_bytes()[:200]),
        "tokenizer.json a list": lambda f: (f / tj).write_text("[]"),
        "tokenizer.json wrong model type": lambda f: (f / tj).write_text(
            json.dumps({**json.loads((f / tj).read_text()), "model": {"type": "Nonsense"}})),
        "tokenizer.json binary": lambda f: (f / tj).write_bytes(bytes(range(256))),
        "tokenizer_config.json invalid JSON": lambda f: (f / "tokenizer_config.json").write_text("{"),
        "no tokenizer files": lambda f: [p.unlink() for p in f.iterdir()],
        "tokenizer.json a folder": lambda f: ((f / tj).unlink(), (f / tj).mkdir()),
    }
    cases = [Case(cat, name, _tokenizer(b, edit), "tok") for name, edit in edits.items()]
    cases += [Case(cat, "sentencepiece model garbage",
                   lambda w: (w.joinpath("sp.model").write_bytes(b"\x00garbage" * 10),
                              cli(["preprocess", "--input", b.jsonl, "--output-prefix", w / "out", "--tokenizer-type",
                                   "SentencePieceTokenizer", "--tokenizer-model", w / "sp.model", "--no-progress"]))[1],
                   "sp.model"),
              Case(cat, "sentencepiece model missing",
                   lambda w: cli(["preprocess", "--input", b.jsonl, "--output-prefix", w / "out", "--tokenizer-type",
                                  "SentencePieceTokenizer", "--tokenizer-model", w / "none.model", "--no-progress"]),
                   "none.model"),
              Case(cat, "GPT-2 vocab.json invalid", _gpt2_bpe(b"{", b"#version: 0.2\n"), "vocab.json"),
              Case(cat, "GPT-2 merges.txt garbage", _gpt2_bpe(b'{"a": 0, "b": 1}', b"\xff\xfe\x00 x y z\n"), "merges.txt"),
              Case(cat, "GPT-2 vocab.json a list", _gpt2_bpe(b"[1, 2]", b"#version: 0.2\n"), "vocab.json"),
              Case(cat, "symlinked tokenizer file leaving the folder", _symlinked_tokenizer(b), "vocab.json")]
    return cases


def _symlinked_tokenizer(b: Bases):
    def run(workdir: Path):
        hf = b.copy(b.gpt2, workdir)
        secret = workdir / "secret.txt"
        secret.write_text("token")
        (hf / "vocab.json").unlink(missing_ok=True)
        (hf / "vocab.json").symlink_to(secret)
        return cli(["convert", "hf-to-megatron", "--hf", hf, "--out", workdir / "out"])
    return run


def data_cases(b: Bases) -> list[Case]:
    return index_cases(b) + jsonl_cases(b) + tokenizer_cases(b)

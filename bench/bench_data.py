"""Data pipeline benchmark: ours vs megatron-core 0.16.1, side by side in one run (CPU).

1. Index build: a synthetic corpus of --tokens tokens (.bin/.idx written directly, document
   lengths log-normal around --mean-doc tokens) -> train/valid/test GPT datasets ("969,30,1",
   seq 2048, --epochs epochs of train samples), cold cache; then the same build again (cache hit);
   then a two-prefix weighted blend.  megatron-core: BlendedMegatronDatasetBuilder + GPTDataset
   (C++ helpers); ours: hf_megatron.data.build_gpt_datasets.  The arrays are also compared.
2. Preprocess: a synthetic JSONL corpus (--docs documents) tokenised with a byte-level BPE trained
   here (32k vocab).  Ours: hf_megatron.data.preprocess (--workers processes).  Anchor:
   Megatron-LM's tools/preprocess_data.py loop (not shipped in the megatron-core wheel) re-enacted:
   Pool(workers).imap(encode, lines, 32) with json.loads + the same tokenizer in the workers and
   megatron-core's IndexedDatasetBuilder.add_document in the main process.

    .venv/bin/python bench/bench_data.py --tokens 1e9 --workers 2
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import time
import warnings

import numpy as np

warnings.simplefilter("ignore")


def write_synthetic(prefix: str, tokens: int, mean_doc: int, seed: int) -> int:
    from hf_megatron.data.indexed import _write_index

    rng = np.random.default_rng(seed)
    lengths = []
    total = 0
    while total < tokens:
        chunk = np.maximum(1, rng.lognormal(np.log(mean_doc), 1.0, size=100_000)).astype(np.int32)
        lengths.append(chunk)
        total += int(chunk.sum(dtype=np.int64))
    lengths = np.concatenate(lengths)
    cut = np.searchsorted(np.cumsum(lengths, dtype=np.int64), tokens)
    lengths = lengths[: cut + 1]
    with open(prefix + ".bin", "wb") as out:  # token values do not matter to index building
        block = rng.integers(0, 50000, size=1 << 24, dtype=np.uint16)
        remaining = int(lengths.sum(dtype=np.int64))
        while remaining:
            n = min(remaining, len(block))
            out.write(block[:n].tobytes())
            remaining -= n
    _write_index(prefix + ".idx", np.uint16, lengths, np.arange(len(lengths) + 1, dtype=np.int64))
    return len(lengths)


class _Tok:
    vocab_size, eod, pad = 50002, 50001, 50000
    unique_identifiers = {"class": "bench"}


def mcore_build(blend, sizes, cache):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(random_seed=1234, sequence_length=2048, blend=blend, split="969,30,1",
                              tokenizer=_Tok(), reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False, path_to_cache=cache)
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def bench_indices(root: str, tokens: int, mean_doc: int, epochs: float) -> list[tuple]:
    from hf_megatron.data import build_gpt_datasets

    a, b = os.path.join(root, "a"), os.path.join(root, "b")
    t_write, docs = timed(lambda: write_synthetic(a, tokens, mean_doc, 0))
    write_synthetic(b, tokens // 4, mean_doc, 1)
    print(f"synthetic corpus: {tokens:.3g} tokens, {docs} documents, written in {t_write:.1f}s", flush=True)
    train = int(epochs * tokens * 0.969 / 2048)
    sizes = [train, train // 100, train // 1000]
    rows = []
    mcore_build(([b], None), [10, 1, 1], None)  # warm-up: imports and the compiled helpers load here
    for label, blend_m, blend_o in [("single prefix", ([a], None), a),
                                    ("blend 0.7/0.3", ([a, b], [0.7, 0.3]), f"0.7 {a} 0.3 {b}")]:
        # megatron-core's BlendedDataset needs a process group to use its cache; give it none
        cache_m = os.path.join(root, "cache_m") if blend_m[1] is None else None
        t_m, ref = timed(lambda: mcore_build(blend_m, sizes, cache_m))
        t_o, ours = timed(lambda: build_gpt_datasets(blend_o, "969,30,1", 2048, 1234, tuple(sizes),
                                                     cache_dir=os.path.join(root, "cache_o")))
        same = all(np.array_equal(getattr(x, n), getattr(y, n)) for x, y in zip(ref, ours)
                   for n in (("document_index", "sample_index", "shuffle_index") if blend_m[1] is None
                             else ("dataset_index", "dataset_sample_index")))
        rows.append((f"index build, {label}, cold", t_m, t_o, same))
        print(rows[-1], flush=True)
        if blend_m[1] is None:
            t_m2, _ = timed(lambda: mcore_build(blend_m, sizes, cache_m))
            t_o2, _ = timed(lambda: build_gpt_datasets(blend_o, "969,30,1", 2048, 1234, tuple(sizes),
                                                       cache_dir=os.path.join(root, "cache_o")))
            rows.append((f"index load, {label}, cache hit", t_m2, t_o2, True))
            print(rows[-1], flush=True)
    return rows, train, docs



def synthetic_jsonl(path: str, docs: int, seed: int) -> int:
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "tor", "ra", "es", "un", "bi", "do", "ver", "sta", "ing", "al", "ph"]
    vocab = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(20000)]
    weights = [1.0 / (i + 1) for i in range(len(vocab))]  # Zipf-like word frequencies
    with open(path, "w") as out:
        for i in range(docs):
            words = rng.choices(vocab, weights, k=rng.randint(20, 800))
            out.write(json.dumps({"text": " ".join(words) + ".", "id": i}) + "\n")
    return os.path.getsize(path)


_encoder = {}


def _init_anchor(tok_dir):
    from transformers import AutoTokenizer

    _encoder["tok"] = AutoTokenizer.from_pretrained(tok_dir)


def _encode_anchor(line):
    text = json.loads(line)["text"]
    ids = _encoder["tok"](text).input_ids
    if ids:
        ids.append(_encoder["tok"].eos_token_id)
    return ids, len(line)


def megatron_lm_style_preprocess(path, tok_dir, out_prefix, workers):
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(out_prefix + ".bin", dtype=np.uint16)
    docs = 0
    with open(path) as lines, multiprocessing.get_context("fork").Pool(workers, _init_anchor, (tok_dir,)) as pool:
        for ids, _ in pool.imap(_encode_anchor, lines, 32):
            builder.add_document(torch.tensor(ids), [len(ids)] if ids else [])
            docs += 1
    builder.finalize(out_prefix + ".idx")
    return docs


def bench_preprocess(root: str, docs: int, workers: int) -> list[tuple]:
    from hf_megatron.data import PreprocessOptions, preprocess, train_bpe_tokenizer
    from hf_megatron.data.sources import read_chunk

    path = os.path.join(root, "corpus.jsonl")
    size = synthetic_jsonl(path, docs, 0)
    sample = (doc["text"] for doc, _ in read_chunk(("json", path, 0, size // 20), ["text"]))
    tok_dir = os.path.join(root, "tok")
    train_bpe_tokenizer(sample, 32000, tok_dir)
    print(f"preprocess corpus: {docs} documents, {size / 1e6:.1f} MB", flush=True)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    t_m, n_m = timed(lambda: megatron_lm_style_preprocess(path, tok_dir, os.path.join(root, "anchor"), workers))
    opts = PreprocessOptions([path], os.path.join(root, "ours"), ["text"], "HuggingFaceTokenizer", tok_dir,
                             append_eod=True, workers=workers, progress=False)
    t_o, stats = timed(lambda: preprocess(opts))
    same = all(open(os.path.join(root, "anchor") + s, "rb").read()
               == open(os.path.join(root, "ours_text_document") + s, "rb").read() for s in (".bin", ".idx"))
    rows = [("preprocess docs/s", n_m / t_m, stats["documents"] / t_o, same),
            ("preprocess MB/s", size / 1e6 / t_m, size / 1e6 / t_o, same)]
    for row in rows:
        print(row, flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=float, default=1e8)
    parser.add_argument("--mean-doc", type=int, default=600)
    parser.add_argument("--epochs", type=float, default=2.5)
    parser.add_argument("--docs", type=int, default=20000)
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 1)))
    parser.add_argument("--workdir", default=None, help="scratch folder (default: a temp dir, removed)")
    args = parser.parse_args()
    root = args.workdir or tempfile.mkdtemp(prefix="bench_data_")
    os.makedirs(root, exist_ok=True)
    try:
        rows, train, docs = bench_indices(root, int(args.tokens), args.mean_doc, args.epochs)
        rows += bench_preprocess(root, args.docs, args.workers)
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)
    import megatron.core
    import tokenizers
    import transformers

    print(f"\nnumpy {np.__version__}, megatron-core {megatron.core.__version__}, transformers "
          f"{transformers.__version__}, tokenizers {tokenizers.__version__}, python {sys.version.split()[0]}, "
          f"{os.cpu_count()} CPUs; train samples {train}, documents {docs}")
    print("| measurement | megatron-core | ours | speed, ours vs megatron-core (>1: ours faster) | identical output |")
    print("| --- | --- | --- | --- | --- |")
    for name, theirs, ours, same in rows:
        if "/s" in name:  # throughput: higher is better
            print(f"| {name} | {theirs:,.1f} | {ours:,.1f} | {ours / theirs:.2f}x | {same} |")
        else:  # seconds: lower is better
            print(f"| {name} (s) | {theirs:.3f} | {ours:.3f} | {theirs / ours:.2f}x | {same} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Preprocess throughput (MB/s of JSON lines) in one run, same corpus, tokenizer and workers:

1. anchor: Megatron-LM's tools/preprocess_data.py loop re-enacted (bench_data.py):
   Pool(workers).imap(encode one document, lines, 32) + megatron-core's IndexedDatasetBuilder;
2. before: hf_megatron.data.preprocess as it was before the backend fast path, i.e. batches of
   256 documents through transformers' ``tokenizer(texts)`` (forced here by hiding the backend);
3. after: hf_megatron.data.preprocess today (batches straight to the Rust tokenizer's
   ``encode_batch_fast``), JSON lines input;
4. after, from a parquet file through ``datasets.load_dataset`` (``--hf-dataset FILE``);
5. after, one process letting the Rust tokenizer use its own threads (workers=1).

Each path runs --repeats times, interleaved with the others, and the best time is shown (a
shared machine's load changes during a run), with the least CPU time (user + system of this
process and its pool workers): MB per CPU second is the load-independent measure of the work.  The load_dataset path includes building its
Arrow cache on the first repeat only (later repeats hit the cache, as a second run would).

Every output .bin/.idx is compared byte for byte with the anchor's.  The corpus is synthetic
(Zipf words, bench_data.synthetic_jsonl) with a byte-level BPE of --vocab tokens trained here.

    .venv/bin/python bench/preprocess.py --docs 20000 --workers 2
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_data import megatron_lm_style_preprocess, synthetic_jsonl  # noqa: E402


def _cpu_seconds() -> float:
    """User + system CPU time of this process and its reaped children (the pool workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _same(a: str, b: str) -> bool:
    return all(open(a + s, "rb").read() == open(b + s, "rb").read() for s in (".bin", ".idx"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=20000)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each path, interleaved; best is shown")
    parser.add_argument("--workdir", default=None, help="scratch folder (default: a temp dir, removed)")
    args = parser.parse_args()
    root = args.workdir or tempfile.mkdtemp(prefix="bench_preprocess_")
    os.makedirs(root, exist_ok=True)
    os.environ.setdefault("HF_DATASETS_CACHE", os.path.join(root, "hf_cache"))
    from hf_megatron.data import PreprocessOptions, preprocess, train_bpe_tokenizer
    from hf_megatron.data import tokenizers as tokenizers_module

    try:
        path = os.path.join(root, "corpus.jsonl")
        size = synthetic_jsonl(path, args.docs, 0)
        with open(path) as lines:
            sample = [json.loads(line)["text"] for _, line in zip(range(max(args.docs // 10, 100)), lines)]
        tok_dir = os.path.join(root, "tok")
        train_bpe_tokenizer(sample, args.vocab, tok_dir)
        import pyarrow as pa
        import pyarrow.parquet as pq
        with open(path) as lines:
            pq.write_table(pa.table({"text": [json.loads(line)["text"] for line in lines]}),
                           os.path.join(root, "corpus.parquet"), row_group_size=1000)
        print(f"corpus: {args.docs} documents, {size / 1e6:.1f} MB JSON lines, BPE vocab {args.vocab}, "
              f"{args.workers} workers, {os.cpu_count()} CPUs", flush=True)

        def ours(name, workers, **extra):
            opts = PreprocessOptions([] if "hf_dataset" in extra else [path], os.path.join(root, name), ["text"],
                                     "HuggingFaceTokenizer", tok_dir, append_eod=True, workers=workers,
                                     progress=False, **extra)
            start = time.perf_counter()
            preprocess(opts)
            return time.perf_counter() - start, os.path.join(root, name + "_text_document")

        anchor = os.path.join(root, "anchor")
        original_init = tokenizers_module.HFTokenizer.__init__

        def without_backend(self, tokenizer):
            original_init(self, tokenizer)
            self._encode_batch = None  # the tokenizer(texts) path, as before

        def before():
            tokenizers_module.HFTokenizer.__init__ = without_backend
            try:
                return ours("before", args.workers)
            finally:
                tokenizers_module.HFTokenizer.__init__ = original_init

        def megatron_lm():
            start = time.perf_counter()
            megatron_lm_style_preprocess(path, tok_dir, anchor, args.workers)
            return time.perf_counter() - start, anchor

        def threads():
            os.environ["TOKENIZERS_PARALLELISM"] = "true"  # (runs with workers > 1 set it to false)
            try:
                return ours("threads", 1)
            finally:
                os.environ["TOKENIZERS_PARALLELISM"] = "false"

        paths = [("anchor: Megatron-LM loop, one document per encode", megatron_lm),
                 ("before: batches through transformers tokenizer(texts)", before),
                 ("after: batches through encode_batch_fast, JSONL", lambda: ours("after", args.workers)),
                 ("after, --hf-dataset corpus.parquet (load_dataset)",
                  lambda: ours("hub", args.workers, hf_dataset=os.path.join(root, "corpus.parquet"))),
                 ("after, 1 process + Rust threads, JSONL", threads)]
        best: dict[str, tuple[float, str]] = {}
        cpu: dict[str, float] = {}
        for repeat in range(args.repeats):  # interleaved, best of: the machine's load changes over a run
            for label, run in paths:
                before_cpu = _cpu_seconds()
                seconds, out = run()
                used = _cpu_seconds() - before_cpu
                print(f"  repeat {repeat}: {label}: {seconds:.2f} s, {used:.2f} CPU s", flush=True)
                if label not in best or seconds < best[label][0]:
                    best[label] = (seconds, out)
                cpu[label] = min(cpu.get(label, used), used)
        rows = [(label, *best[label]) for label, _ in paths]
        base = rows[0][1]
        base_cpu = cpu[rows[0][0]]
        print("\n| path | seconds | MB/s | vs anchor | CPU s | MB per CPU s | vs anchor | identical to anchor |\n"
              "| --- | --- | --- | --- | --- | --- | --- | --- |")
        for label, seconds, out in rows:
            print(f"| {label} | {seconds:.2f} | {size / 1e6 / seconds:.2f} | {base / seconds:.2f}x | {cpu[label]:.2f} | "
                  f"{size / 1e6 / cpu[label]:.2f} | {base_cpu / cpu[label]:.2f}x | {_same(anchor, out)} |")
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)
    import datasets
    import tokenizers
    import transformers
    print(f"\ntransformers {transformers.__version__}, tokenizers {tokenizers.__version__}, "
          f"datasets {datasets.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tokenise a corpus into ``{output_prefix}_{key}_document.bin/.idx`` (Megatron-LM's preprocess_data).

Each input is cut into chunks (sources.py); ``workers`` processes each tokenise whole chunks
into their own small indexed datasets, which are then concatenated in chunk order.  So the
output is the same for any ``workers`` / ``partitions``, no token arrays cross processes, and a
crash leaves only a temporary folder behind (final files are renamed into place last).

One document per record: the record's text for each key is tokenised (special tokens as the
tokenizer adds them); with ``append_eod`` the end-of-document id is appended to non-empty
documents.  A document is one sequence (Megatron-LM's document level, no sentence splitting),
except a JSON list of strings, whose elements are its sequences (Megatron-LM's Encoder.encode).

With ``sft`` the keys are PROMPT RESPONSE (or one chat MESSAGES field) and the output is one
token dataset ``{output_prefix}_sft_document`` plus its loss mask ``..._sft_document_loss_mask``
(uint8, 1 = response token), an indexed dataset with the same documents and sequence lengths
(sft_records.py says how the mask is made; sft.py reads both).
"""
from __future__ import annotations

import glob
import multiprocessing
import os
import shutil
import sys
import time
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError, DataError
from .cache import check_output_folder
from .indexed import IndexedDatasetWriter, optimal_dtype
from .sft_records import check_sft_keys, encode_sft_batch, loss_mask_prefix
from .hub import HF_SCHEME
from .sources import BlankLines, expand_inputs, plan_chunks, read_chunk, record_place, resolve_sources
from .tokenizers import build_tokenizer

BATCH_DOCS = 256
_worker_state: dict = {}


@dataclass
class PreprocessOptions:
    inputs: list[str]
    output_prefix: str
    json_keys: list[str]
    tokenizer_type: str
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    vocab_size: int | None = None
    append_eod: bool = False
    workers: int = 1
    partitions: int = 1
    split: str | None = None
    progress: bool = True
    log_interval: int | None = None  # Megatron-LM's "Processed N documents" line every N documents, not the bar
    sft: bool = False
    hf_dataset: str | None = None   # datasets.load_dataset inputs (hub.py), after `inputs`
    hf_subset: str | None = None
    hf_split: str | None = None     # None: "train"
    streaming: bool = False


SFT_NAME, SFT_MASK = "sft", "sft_loss_mask"


def output_prefix_for(prefix: str, key: str) -> str:
    return f"{prefix}_{key}_document"


def _channels(options: PreprocessOptions, dtype_name: str) -> list[tuple[str, str, str]]:
    """(name, final prefix, dtype) of each indexed dataset written: one per key, or SFT tokens + mask."""
    if options.sft:
        tokens = output_prefix_for(options.output_prefix, SFT_NAME)
        return [(SFT_NAME, tokens, dtype_name), (SFT_MASK, loss_mask_prefix(tokens), "uint8")]
    return [(key, output_prefix_for(options.output_prefix, key), dtype_name) for key in options.json_keys]


def _tokenizer_of(options: PreprocessOptions):
    return build_tokenizer(options.tokenizer_type, options.tokenizer_model, options.vocab_file,
                           options.merge_file, options.vocab_size)


def _init_worker(options: PreprocessOptions, counters=None) -> None:
    """``counters``: shared (documents, bytes) Values a worker process adds to as it goes, for
    --log-interval; in the main process ``_worker_state["report"]`` is set directly."""
    _worker_state["tokenizer"] = _tokenizer_of(options)
    _worker_state["options"] = options
    if counters is not None:
        def report(docs: int, nbytes: int) -> None:
            with counters[0].get_lock():
                counters[0].value += docs
                counters[1].value += nbytes
        _worker_state["report"] = report


def _encode_chunk(job: tuple[int, tuple, str, str]) -> tuple[int, int, int, int, BlankLines]:
    """Tokenise chunk ``job`` into ``{part_prefix}_{key}``; returns (index, docs, bytes, tokens, the
    blank lines skipped)."""
    index, chunk, part_prefix, dtype_name = job
    tokenizer, options = _worker_state["tokenizer"], _worker_state["options"]
    keys = options.json_keys
    writers = {name: IndexedDatasetWriter(f"{part_prefix}_{name}", np.dtype(dtype))
               for name, _, dtype in _channels(options, dtype_name)}
    docs = nbytes = ntokens = 0
    reported = [0, 0]  # documents, bytes already reported for --log-interval
    report = _worker_state.get("report")
    batch_docs = min(BATCH_DOCS, options.log_interval) if options.log_interval else BATCH_DOCS
    batch: list[dict] = []
    blank_lines = BlankLines()

    def add(writer, ids) -> None:
        writer.add_document(ids, [len(ids)] if len(ids) else [])

    def flush():
        nonlocal ntokens
        if options.sft:
            first = docs - len(batch)  # the batch's first document in the chunk
            encoded = encode_sft_batch(tokenizer, batch, keys, options.append_eod,
                                       lambda i: record_place(chunk, first + i))
            for ids, mask in encoded:
                add(writers[SFT_NAME], ids)
                add(writers[SFT_MASK], mask)
                ntokens += len(ids)
        else:
            for key in keys:
                for ids, lengths in _encode_documents(tokenizer, [doc[key] for doc in batch], options.append_eod):
                    writers[key].add_document(ids, lengths)
                    ntokens += len(ids)
        batch.clear()
        if report is not None:
            report(docs - reported[0], nbytes - reported[1])
            reported[:] = docs, nbytes

    try:
        for doc, size in read_chunk(chunk, keys, chat=options.sft, blank_lines=blank_lines):
            batch.append(doc)
            docs += 1
            nbytes += size
            if len(batch) == batch_docs:
                flush()
        flush()
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    for writer in writers.values():
        writer.finalize()
    return index, docs, nbytes, ntokens, blank_lines


def _encode_documents(tokenizer, values: list, append_eod: bool) -> list[tuple[list[int], list[int]]]:
    """(ids, sequence lengths) of each document, as Megatron-LM's Encoder.encode makes them: a
    string is one sentence, a list of strings one sentence per element, each tokenised alone
    (special tokens per element); empty sentences are dropped, the rest concatenated, one
    sequence each; the eod id joins the last sequence of a non-empty document."""
    sentences = [value if isinstance(value, list) else [value] for value in values]
    flat = iter(tokenizer.tokenize_batch([str(text) for parts in sentences for text in parts]))
    documents = []
    for parts in sentences:
        pieces = [list(ids) for ids in (next(flat) for _ in parts) if len(ids)]
        ids = [token for piece in pieces for token in piece]
        lengths = [len(piece) for piece in pieces]
        if ids and append_eod:
            ids.append(tokenizer.eod)
            lengths[-1] += 1
        documents.append((ids, lengths))
    return documents


class IntervalLog:
    """Megatron-LM's print_processing_stats: ``Processed N documents (x docs/s, y MB/s).`` on stderr
    each time the document count reaches a multiple of ``interval`` (MB as Megatron-LM counts it,
    2**20 bytes of input lines)."""

    def __init__(self, interval: int, start: float):
        self.interval, self.start = interval, start
        self.documents = self.bytes = 0

    def add(self, documents: int, nbytes: int) -> None:
        self.set(self.documents + documents, self.bytes + nbytes)

    def set(self, documents: int, nbytes: int) -> None:
        crossed = range((self.documents // self.interval + 1) * self.interval, documents + 1, self.interval)
        self.documents, self.bytes = documents, nbytes
        if len(crossed):
            elapsed = max(time.perf_counter() - self.start, 1e-9)
            for count in crossed:
                print(f"Processed {count} documents ({count / elapsed:.2f} docs/s, "
                      f"{nbytes / elapsed / 1024 / 1024:.2f} MB/s).", file=sys.stderr, flush=True)


def _polled(results, poll):
    """The pool's results, calling ``poll`` between them and every 0.2 s while waiting."""
    while True:
        try:
            item = results.next(timeout=0.2)
        except StopIteration:
            poll()
            return
        except multiprocessing.TimeoutError:
            poll()
            continue
        poll()
        yield item


def _progress(options: PreprocessOptions, total_docs: int | None):
    if not options.progress or options.log_interval:
        return None
    from tqdm import tqdm

    return tqdm(total=total_docs, unit="docs", unit_scale=True, desc="preprocess", mininterval=0.5)


def _check_split_flags(options: PreprocessOptions) -> None:
    """--hf-split / --hf-subset / --streaming apply to load_dataset inputs (--hf-dataset, --input hf://NAME),
    --split to saved DatasetDict folders under --input: one given where no input takes it was read as
    "train" / ignored without a word."""
    plain = [str(item) for item in options.inputs if not str(item).startswith(HF_SCHEME)]
    if not options.hf_dataset and len(plain) == len(options.inputs):
        for flag, value in (("--hf-split", options.hf_split), ("--hf-subset", options.hf_subset),
                            ("--streaming", options.streaming)):
            if value:
                given = flag if value is True else f"{flag} {value}"
                raise ConfigError(f"{given}: applies to --hf-dataset / --input hf://NAME inputs and none is given "
                                  f"(--input {' '.join(plain)}); a saved DatasetDict folder under --input takes --split")
    if options.split is not None and not any(os.path.isfile(os.path.join(path, "dataset_dict.json"))
                                             for item in plain for path in glob.glob(item) or [item]):
        raise ConfigError(f"--split {options.split}: picks the split of a saved DatasetDict folder under --input "
                          "and none is given; for --hf-dataset / --input hf://NAME use --hf-split")


def check_options(options: PreprocessOptions) -> None:
    """What needs no tokenizer and no input read: one line each, before anything is written."""
    if not options.json_keys:
        raise ConfigError("--json-keys needs at least one key")
    repeated = sorted({key for key in options.json_keys if options.json_keys.count(key) > 1})
    if repeated:
        raise ConfigError(f"--json-keys {' '.join(options.json_keys)}: expected each key once, got "
                          f"{', '.join(map(repr, repeated))} more than once")
    if options.workers < 1 or options.partitions < 1:
        raise ConfigError("--workers and --partitions must be >= 1")
    if options.log_interval is not None and options.log_interval < 1:
        raise ConfigError(f"--log-interval {options.log_interval}: expected a number of documents >= 1")
    _check_split_flags(options)
    check_output_folder("--output-prefix", options.output_prefix,
                        os.path.dirname(os.path.abspath(options.output_prefix)))


def preprocess(options: PreprocessOptions) -> dict:
    """Run the whole preprocessing; returns counts, the output prefixes and warning lines (blank
    lines skipped, one line per input file that has some)."""
    check_options(options)
    tokenizer = _tokenizer_of(options)  # fails fast in the main process on a bad tokenizer
    if options.sft:
        check_sft_keys(tokenizer, options.json_keys)
    if options.append_eod and tokenizer.eod is None:
        raise DataError(f"--append-eod: tokenizer {options.tokenizer_model or options.tokenizer_type} has no "
                         "end-of-document (eos) token")
    dtype_name = np.dtype(optimal_dtype(tokenizer.vocab_size)).name
    paths = expand_inputs(resolve_sources(options.inputs, options.hf_dataset, options.hf_subset,
                                          options.hf_split or "train", options.streaming))
    chunks = plan_chunks(paths, max(options.partitions, 4 * options.workers if options.workers > 1 else 1),
                         64 << 20, options.split)
    out_dir = os.path.dirname(os.path.abspath(options.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    parts_dir = os.path.abspath(options.output_prefix) + f".parts.tmp{os.getpid()}"
    os.makedirs(parts_dir, exist_ok=True)
    jobs = [(i, chunk, os.path.join(parts_dir, f"{i:06d}"), dtype_name) for i, chunk in enumerate(chunks)]
    totals = {"documents": 0, "bytes": 0, "tokens": 0}
    known = all(chunk[0] == "hub" for chunk in chunks)  # row ranges: the document count is known
    bar = _progress(options, sum(chunk[3] - chunk[2] for chunk in chunks) if known else None)
    start = time.perf_counter()
    log = IntervalLog(options.log_interval, start) if options.log_interval else None
    pool, parallelism = None, os.environ.get("TOKENIZERS_PARALLELISM")
    try:
        if options.workers == 1:
            _init_worker(options)
            if log is not None:
                _worker_state["report"] = log.add
            results = map(_encode_chunk, jobs)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = "false"  # forked workers must not share Rust threads
            methods = multiprocessing.get_all_start_methods()
            context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
            counters = (context.Value("q", 0), context.Value("q", 0)) if log is not None else None
            pool = context.Pool(options.workers, initializer=_init_worker, initargs=(options, counters))
            results = pool.imap_unordered(_encode_chunk, jobs)
            if log is not None:
                results = _polled(results, lambda: log.set(counters[0].value, counters[1].value))
        blank_lines: dict[str, BlankLines] = {}  # per input file
        for index, docs, nbytes, ntokens, blanks in results:
            if blanks.count:
                blank_lines.setdefault(jobs[index][1][1], BlankLines()).merge(blanks)
            totals["documents"] += docs
            totals["bytes"] += nbytes
            totals["tokens"] += ntokens
            if bar is not None:
                elapsed = max(time.perf_counter() - start, 1e-9)
                bar.update(docs)
                bar.set_postfix_str(f"{totals['bytes'] / elapsed / 1e6:.2f} MB/s")
        if pool is not None:
            pool.close()
            pool.join()
            pool = None
        if not totals["documents"]:
            raise DataError(f"{', '.join(options.inputs)}: no documents (empty input); nothing to write")
        outputs = {}
        for name, final, dtype in _channels(options, dtype_name):
            with IndexedDatasetWriter(final, np.dtype(dtype)) as writer:
                for job in jobs:
                    writer.add_index(f"{job[2]}_{name}")
            outputs[name] = final
    finally:
        if pool is not None:
            pool.terminate()
        if options.workers > 1:  # the caller's setting back (one process tokenises with Rust threads)
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
            if parallelism is not None:
                os.environ["TOKENIZERS_PARALLELISM"] = parallelism
        if bar is not None:
            bar.close()
        _worker_state.pop("report", None)
        shutil.rmtree(parts_dir, ignore_errors=True)
    elapsed = time.perf_counter() - start
    in_input_order = sorted(blank_lines.items(), key=lambda item: paths.index(item[0]))
    totals.update(outputs=outputs, warnings=[blanks.warning(path) for path, blanks in in_input_order], seconds=elapsed,
                  docs_per_s=totals["documents"] / max(elapsed, 1e-9),
                  mb_per_s=totals["bytes"] / 1e6 / max(elapsed, 1e-9), dtype=dtype_name)
    return totals


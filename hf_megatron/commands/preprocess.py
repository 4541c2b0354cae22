"""`hf-megatron preprocess`: corpus -> Megatron .bin/.idx, with Megatron-LM's flag names.

    hf-megatron preprocess --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model gpt2 --append-eod --workers 8

writes data/corpus_text_document.bin/.idx (one pair per --json-keys key).  With --sft and
--json-keys prompt response (or --json-keys messages, a chat list) it writes one token dataset
data/corpus_sft_document plus a parallel loss mask data/corpus_sft_document_loss_mask.  With
--train-tokenizer {bpe,sentencepiece} --vocab-size N a new tokenizer is first trained on the
input and saved to --tokenizer-model (a directory for bpe, a .model file for sentencepiece).
"""
from __future__ import annotations

import argparse
import sys

from ..errors import ConfigError


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "preprocess", help="tokenise a corpus into Megatron .bin/.idx indexed datasets",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_argument_group("input data")
    group.add_argument("--input", nargs="+", default=[],
                       help="JSON lines (.json/.jsonl), text (.txt, one document per line), either gzipped (.jsonl.gz), .parquet, "
                            "a datasets dir saved with save_to_disk, or hf://NAME (as --hf-dataset); globs allowed")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="fields to tokenise (default: text)")
    group.add_argument("--split", default=None, help="split of a saved DatasetDict (default: train)")
    group.add_argument("--sft", action="store_true",
                       help="SFT data: --json-keys PROMPT RESPONSE (or one chat MESSAGES field, rendered with the "
                            "tokenizer's chat template, assistant turns scored) -> {prefix}_sft_document plus its "
                            "loss mask {prefix}_sft_document_loss_mask (for `train --sft`)")
    group = parser.add_argument_group("Hugging Face datasets (datasets.load_dataset; offline on local data)")
    group.add_argument("--hf-dataset", metavar="NAME",
                       help="Hub id, local folder of data files, single data file (.parquet/.jsonl/.arrow/.csv/.txt) "
                            "or save_to_disk folder")
    group.add_argument("--hf-subset", help="configuration name (load_dataset's `name`)")
    group.add_argument("--hf-split", default=None, help="split to read (default: train)")
    group.add_argument("--streaming", action="store_true",
                       help="stream the rows (no Arrow cache written); workers read contiguous file shards")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True,
                       choices=["HuggingFaceTokenizer", "GPT2BPETokenizer", "SentencePieceTokenizer",
                                "GPTSentencePieceTokenizer", "Llama2Tokenizer", "NullTokenizer"])
    group.add_argument("--tokenizer-model", help="tokenizer dir / Hub id, or SentencePiece .model")
    group.add_argument("--vocab-file", help="GPT-2 vocab.json")
    group.add_argument("--merge-file", help="GPT-2 merges.txt")
    group.add_argument("--vocab-size", type=int, help="NullTokenizer: ids 0..N-1, eod N (megatron-core's); or the "
                                                      "size to train")
    group.add_argument("--append-eod", action="store_true", help="append the end-of-document token")
    group.add_argument("--train-tokenizer", choices=["bpe", "sentencepiece"],
                       help="train a new tokenizer on the input first, saved at --tokenizer-model")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenising processes")
    group.add_argument("--partitions", type=int, default=1, help="minimum chunks per input file")
    group.add_argument("--log-interval", type=int, default=None, metavar="N",
                       help="print Megatron-LM's 'Processed N documents (x docs/s, y MB/s).' line on stderr every N "
                            "documents, instead of the progress bar")
    group.add_argument("--no-progress", action="store_true",
                       help="no progress bar (--log-interval lines are still printed)")
    parser.set_defaults(func=run)


BPE_MIN_VOCAB = 257  # a byte-level BPE holds the 256 bytes and its end-of-text token before any merge


def _check_tokenizer_target(args) -> None:
    """Before the corpus is read: a vocabulary the trainer can give, and nothing overwritten."""
    import os
    if args.train_tokenizer == "bpe":
        if args.vocab_size < BPE_MIN_VOCAB:
            raise ConfigError(f"--vocab-size {args.vocab_size}: expected at least {BPE_MIN_VOCAB} for --train-tokenizer "
                              "bpe (a byte-level BPE holds the 256 byte tokens and <|endoftext|>)")
        target = args.tokenizer_model
        taken = os.path.exists(target) and (not os.path.isdir(target) or os.listdir(target))
    else:
        model = args.tokenizer_model if args.tokenizer_model.endswith(".model") else args.tokenizer_model + ".model"
        target, taken = model, os.path.exists(model)
    if taken:
        raise ConfigError(f"--tokenizer-model {args.tokenizer_model}: {target} already exists and --train-tokenizer "
                          f"would overwrite it; give a new path (or remove it, or drop --train-tokenizer to use it)")


def _train_tokenizer(args) -> None:
    from hf_megatron.data.sources import expand_inputs, plan_chunks, read_chunk, resolve_sources
    from hf_megatron.data.tokenizers import train_bpe_tokenizer, train_sentencepiece_tokenizer

    if not args.tokenizer_model or not args.vocab_size:
        raise ConfigError("--train-tokenizer needs --tokenizer-model (where to save) and --vocab-size")
    _check_tokenizer_target(args)
    sources = resolve_sources(args.input, args.hf_dataset, args.hf_subset, args.hf_split or "train", args.streaming)
    chunks = plan_chunks(expand_inputs(sources), 1, 1 << 62, args.split)
    values = (doc[k] for chunk in chunks for doc, _ in read_chunk(chunk, args.json_keys) for k in args.json_keys)
    texts = (str(text) for value in values for text in (value if isinstance(value, list) else [value]))
    if args.train_tokenizer == "bpe":
        if args.tokenizer_type != "HuggingFaceTokenizer":
            raise ConfigError("--train-tokenizer bpe saves a transformers tokenizer: use --tokenizer-type HuggingFaceTokenizer")
        train_bpe_tokenizer(texts, args.vocab_size, args.tokenizer_model)
    else:
        if args.tokenizer_type not in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
            raise ConfigError("--train-tokenizer sentencepiece needs a SentencePiece --tokenizer-type")
        prefix = args.tokenizer_model[:-len(".model")] if args.tokenizer_model.endswith(".model") else args.tokenizer_model
        args.tokenizer_model = train_sentencepiece_tokenizer(texts, args.vocab_size, prefix)


def run(args) -> int:
    import dataclasses

    from hf_megatron.data.preprocess import PreprocessOptions, check_options, preprocess

    options = PreprocessOptions(
        inputs=args.input, output_prefix=args.output_prefix, json_keys=args.json_keys,
        tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file, merge_file=args.merge_file, vocab_size=args.vocab_size,
        append_eod=args.append_eod, workers=args.workers, partitions=args.partitions,
        split=args.split, progress=not args.no_progress, log_interval=args.log_interval, sft=args.sft, hf_dataset=args.hf_dataset,
        hf_subset=args.hf_subset, hf_split=args.hf_split, streaming=args.streaming)
    check_options(options)  # before a tokenizer is trained
    if args.train_tokenizer:
        _train_tokenizer(args)
        options = dataclasses.replace(options, tokenizer_model=args.tokenizer_model)
    stats = preprocess(options)
    for line in stats["warnings"]:
        print(f"hf-megatron preprocess: warning: {line}", file=sys.stderr)
    for key, prefix in stats["outputs"].items():
        print(f"{key}: {prefix}.bin / .idx")
    print(f"{stats['documents']} documents, {stats['tokens']} tokens ({stats['dtype']}) in "
          f"{stats['seconds']:.1f}s: {stats['docs_per_s']:.0f} docs/s, {stats['mb_per_s']:.2f} MB/s",
          file=sys.stderr)
    return 0

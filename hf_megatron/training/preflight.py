"""Checks of a training run that need no model: done before the model is built (seconds, not the
minutes a large model takes to load), on every rank alike, each failing with one line.

* every --data-path prefix opens (.idx and .bin exist, header valid);
* the splits the run reads (train; valid when it validates: RunConfig.validates) get at least one sample's
  worth of tokens from every prefix -- the test split is never read by `train`, so it is not checked
  (nor built);
* --seq-length fits a model with learned absolute positions (rotary models extrapolate);
* a NullTokenizer's --vocab-size N beside --hf-config / --hf-model: its N + 1 ids fit the model's vocabulary;
* --save, --tensorboard-dir and --data-cache-path can be folders (no file on their path, writable);
* --ckpt-format torch_dist: not with --use-distributed-optimizer (torch_dist_save.unsupported).
Batch divisibility is TrainingConfig.num_micro_batches', checked when the global batch is computed.
"""
from __future__ import annotations

from ..config import ModelConfig
from ..data.builder import SPLITS, parse_data_path, split_bookends
from ..data.cache import check_output_folder
from ..data.indexed import IndexedDataset
from ..errors import ConfigError, DataError, ParallelConfigError
from .config import RunConfig


def used_splits(run: RunConfig) -> tuple[str, ...]:
    return ("train", "valid") if run.validates() else ("train",)


def check_data(run: RunConfig) -> None:
    prefixes, _ = parse_data_path(run.data_path)
    bookends = split_bookends(run.split)
    if bookends[0] is None:
        raise DataError(f"--split {run.split!r}: the training split gets no share")
    for prefix in prefixes:
        indexed = IndexedDataset(prefix)  # a missing or broken file: one line naming it
        count = len(indexed)
        for name, ends in zip(SPLITS, bookends):
            if name not in used_splits(run) or ends is None:
                continue
            begin, end = int(round(ends[0] * float(count))), int(round(ends[1] * float(count)))
            tokens = int(indexed.sequence_lengths[begin:end].sum(dtype="int64"))
            if tokens < 2:  # a sample needs its seq_length tokens + 1 target, wrapping over epochs
                raise DataError(f"--split {run.split!r}: the {name} split of {prefix} gets sequences {begin}..{end} "
                                f"of {count} ({tokens} tokens), too few for one sample; give it a larger share "
                                f"or more data")


def check_model_fits(seq_length: int, config: ModelConfig) -> None:
    """`train` and `evaluate`: --seq-length within a learned-position model's positions."""
    if config.position_embedding_type == "learned_absolute" and seq_length > config.max_position_embeddings:
        raise ConfigError(f"--seq-length {seq_length}: expected at most the model's {config.max_position_embeddings} "
                          "positions (max_position_embeddings / n_positions of its config)")


def check_null_tokenizer_fits(run, config: ModelConfig) -> None:
    """`train --tokenizer-type NullTokenizer --vocab-size N` with the model from --hf-config / --hf-model / a
    checkpoint: the tokenizer's N + 1 ids (its eod is N) within the model's vocabulary."""
    size = run.null_tokenizer_vocab_size()
    if size is not None and size + 1 > config.vocab_size:
        source = (f"--hf-config {run.hf_config}" if run.hf_config else f"--hf-model {run.hf_model}" if run.hf_model
                  else "the checkpoint's config")
        raise ConfigError(f"--vocab-size {size}: --tokenizer-type NullTokenizer's ids 0..{size} (eod {size}) do not "
                          f"fit the model's vocab_size {config.vocab_size} ({source}); expected --vocab-size at most "
                          f"{config.vocab_size - 1}")


def check_pipeline_split(cfg, config: ModelConfig) -> None:
    """`train` and `evaluate`: the pipeline chunks (stages x virtual chunks) split the layers evenly
    (there is no flag for an uneven split), named by the flags."""
    pp, vpp = cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size or 1
    if config.num_layers % (pp * vpp):
        flags = f"--pipeline-model-parallel-size {pp}" + (
            f" x --virtual-pipeline-model-parallel-size {vpp} = {pp * vpp} model chunks" if vpp > 1 else "")
        raise ParallelConfigError(f"{flags}: expected a divisor of the model's {config.num_layers} layers (each "
                                  "chunk holds the same number of layers)")


def check_output_folders(run) -> None:
    """`train` and `evaluate`: the folders the run will write, before anything is built."""
    for flag, value in (("--save", getattr(run, "save", None)), ("--tensorboard-dir", getattr(run, "tensorboard_dir", None)),
                        ("--data-cache-path", run.data_cache_path)):
        if value:
            check_output_folder(flag, value)


def check_save_format(cfg, run) -> None:
    """`train --save --ckpt-format torch_dist`: not with the distributed optimizer (one line naming the flag)."""
    from .torch_dist_save import unsupported
    why = unsupported(cfg.use_distributed_optimizer) if run.save and run.ckpt_format == "torch_dist" else None
    if why:
        raise ConfigError(why)

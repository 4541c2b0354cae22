"""The three conversions: HF -> Megatron, Megatron -> HF, Megatron -> Megatron (reshard).

Every output is built in a hidden staging folder next to `out` and renamed into place only
after all files (and `--verify`, when asked) succeeded; the Megatron tracker file is written
last inside it.  An interrupted run leaves `.<out>.partial-*`, never a folder that looks done.

A Megatron folder we write also keeps what HF needs to come back exactly: `args.hf_config`,
`args.hf_generation_config`, and the tokenizer files in `<out>/tokenizer/`.
"""
from __future__ import annotations

import json
import os
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import torch

from ..architectures import hf_to_mcore, mcore_to_hf
from ..checkpoint.args import tokenizer_args
from ..checkpoint.files import TRACKER, StagingDir, iter_dir_name, within, write_text_atomic
from ..checkpoint.load import open_megatron
from ..checkpoint.names import layer_index
from ..checkpoint.torch_dist import write_torch_dist
from ..checkpoint.writer import write_megatron
from ..errors import CheckpointError, ConfigError
from .hf_io import HFCheckpoint
from .hf_writer import DTYPES, copy_tokenizer, write_hf_config, write_hf_weights
from .verify import compare, compare_tensors, fixed_prompt, hf_logits, megatron_logits

TOKENIZER_SUBDIR = "tokenizer"
TRAINING_INFO = "hf_megatron_training.json"


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(f"--dtype must be one of {', '.join(sorted(DTYPES))}, got {name!r}") from None


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


CKPT_FORMATS = ("torch", "torch_dist")  # Megatron-LM's --ckpt-format names


def check_output_format(ckpt_format: str, legacy_names: bool, vpp: int | None) -> None:
    if ckpt_format not in CKPT_FORMATS:
        raise ConfigError(f"--ckpt-format must be one of {', '.join(CKPT_FORMATS)}, got {ckpt_format!r}")
    if ckpt_format == "torch_dist" and (legacy_names or vpp):
        raise ConfigError("--ckpt-format torch_dist: one folder for every layout, megatron-core names; "
                          "--legacy-names and --vpp apply to the torch format only")


def _write_output(iter_dir: Path, config, source, tp: int, pp: int, vpp: int | None, iteration, args: dict,
                  extra: dict | None, ckpt_format: str, legacy_names: bool, rank_extra=None) -> None:
    if ckpt_format == "torch_dist":
        write_torch_dist(iter_dir, config, source, tp, pp, iteration, args)
    else:
        write_megatron(iter_dir, config, source, tp, pp, vpp, iteration, args, extra, legacy_names=legacy_names,
                       rank_extra=rank_extra)


def _carry_tokenizer(source: Path, tokenizer_dir: Path) -> list[str]:
    """Copy the tokenizer files into `tokenizer_dir`; no folder at all when there are none."""
    tokenizer_dir.mkdir()
    copied = copy_tokenizer(source, tokenizer_dir)
    if not copied:
        tokenizer_dir.rmdir()
    return copied


@contextmanager
def _staged(out: str | os.PathLike):
    """`StagingDir(out)`, removed again however the conversion ends short of its commit.  An exception or
    Ctrl-C unwinds through StagingDir's clean-up; SIGTERM and SIGHUP (a `kill`, a job scheduler's stop, a
    closed terminal) would end the process without it, so while their handlers are the default they raise
    SystemExit(128 + signal) instead.  (SIGKILL cannot be caught: it leaves `.<out>.partial-*`, never `out`.)"""
    previous = {}
    if threading.current_thread() is threading.main_thread():  # only there can handlers be set
        for sig in filter(None, (signal.SIGTERM, getattr(signal, "SIGHUP", None))):
            if signal.getsignal(sig) == signal.SIG_DFL:
                previous[sig] = signal.signal(sig, _exit_on_signal)
    try:
        with StagingDir(out) as staging:
            yield staging
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _finish_megatron(staging: StagingDir, iteration) -> None:
    write_text_atomic(staging.path / TRACKER, str(iteration))


def hf_to_megatron(hf: str | os.PathLike, out: str | os.PathLike, tp: int = 1, pp: int = 1, vpp: int | None = None,
                   dtype: str | None = None, verify: bool = False, ckpt_format: str = "torch",
                   legacy_names: bool = False, tokenizer: str | os.PathLike | None = None) -> dict[str, Any]:
    """`tokenizer`: a folder of tokenizer files to carry (default: the HF folder's own)."""
    check_output_format(ckpt_format, legacy_names, vpp)
    source_ckpt = HFCheckpoint(hf)
    tokenizer_src = Path(tokenizer) if tokenizer else source_ckpt.path
    if tokenizer and not tokenizer_src.is_dir():
        raise CheckpointError(f"{tokenizer_src}: tokenizer folder not found (--tokenizer)")
    config = source_ckpt.model_config()
    source_ckpt.check(config)  # every tensor present at its shape, before anything is written
    target = parse_dtype(dtype)
    generation = source_ckpt.file("generation_config.json")
    args = {"hf_generation_config": json.loads(generation.read_text())} if generation.is_file() else {}
    # Megatron-LM's tokenizer args name the copy in <out>/tokenizer
    args["tokenizer"] = tokenizer_args(tokenizer_src, Path(out).absolute() / TOKENIZER_SUBDIR)

    def source(layers):
        return ((n, _cast(t, target)) for n, t in hf_to_mcore(source_ckpt.get, config, layers))

    report: dict[str, Any] = {"out": str(out), "tp": tp, "pp": pp, "vpp": vpp}
    with _staged(out) as staging:
        _write_output(staging.path / iter_dir_name("release"), config, source, tp, pp, vpp, "release", args, None,
                      ckpt_format, legacy_names)
        report["tokenizer_files"] = _carry_tokenizer(tokenizer_src, staging.path / TOKENIZER_SUBDIR)
        _finish_megatron(staging, "release")
        if verify:
            written = open_megatron(staging.path)
            # back through the inverse mapping: a wrong tensor (or row) of the forward one shows
            tensors = compare_tensors(mcore_to_hf(written.get, config), source_ckpt.get, target)
            ids = fixed_prompt(config.vocab_size, config.max_position_embeddings)
            report["verify"] = compare(hf_logits(source_ckpt.path, ids, round_to=target), megatron_logits(written, ids),
                                       tensors=tensors)
        staging.commit()
    return report


def _megatron_root(path: Path) -> Path:
    return path if (path / TRACKER).is_file() else path.parent


def _megatron_tokenizer(src: str | os.PathLike) -> Path:
    """`<root>/tokenizer` of a Megatron checkpoint, kept inside the checkpoint folder."""
    root = _megatron_root(Path(src))
    return within(root / TOKENIZER_SUBDIR, root)


def megatron_to_hf(megatron: str | os.PathLike, out: str | os.PathLike, dtype: str | None = None,
                   tokenizer: str | os.PathLike | None = None, max_shard_size: int | str = "5GB",
                   verify: bool = False, vocab_size: int | None = None) -> dict[str, Any]:
    if vocab_size is not None and vocab_size < 1:
        raise ConfigError(f"--vocab-size: expected a positive number, got {vocab_size}")
    ckpt = open_megatron(megatron, vocab_size=vocab_size)
    if vocab_size is not None and vocab_size != ckpt.config.vocab_size:
        raise ConfigError(f"--vocab-size {vocab_size} disagrees with the checkpoint's vocabulary of "
                          f"{ckpt.config.vocab_size} (its args.hf_config); leave the flag out")
    target = parse_dtype(dtype)
    out_dtype = target or _stored_dtype(ckpt)
    tokenizer_src = Path(tokenizer) if tokenizer else _megatron_tokenizer(megatron)
    if tokenizer and not tokenizer_src.is_dir():
        raise CheckpointError(f"{tokenizer_src}: tokenizer folder not found (--tokenizer)")
    report: dict[str, Any] = {"out": str(out), "dtype": str(out_dtype).replace("torch.", "")}
    with _staged(out) as staging:
        report.update(write_hf_weights(staging.path, ckpt.config, ckpt.get, out_dtype, max_shard_size))
        write_hf_config(staging.path, ckpt.config, out_dtype, getattr(ckpt.args, "hf_generation_config", None))
        report["tokenizer_files"] = copy_tokenizer(tokenizer_src, staging.path)
        info = training_info(ckpt)
        (staging.path / TRAINING_INFO).write_text(json.dumps(info, indent=2, default=str) + "\n")
        if verify:
            tensors = compare_tensors(hf_to_mcore(HFCheckpoint(staging.path).get, ckpt.config), ckpt.get, out_dtype)
            ids = fixed_prompt(ckpt.config.vocab_size, ckpt.config.max_position_embeddings)
            report["verify"] = compare(megatron_logits(ckpt, ids, round_to=out_dtype), hf_logits(staging.path, ids),
                                       tensors=tensors)
        staging.commit()
    return report


def _stored_dtype(ckpt) -> torch.dtype:
    return ckpt.get("decoder.final_layernorm.weight").dtype


def training_info(ckpt) -> dict[str, Any]:
    """What the model card reports: iterations, tokens, final loss, parallel layout."""
    args = ckpt.args
    info = {"iteration": ckpt.iteration, "tensor_model_parallel_size": getattr(args, "tensor_model_parallel_size", ckpt.tp),
            "pipeline_model_parallel_size": getattr(args, "pipeline_model_parallel_size", ckpt.pp),
            "data_parallel_size": getattr(args, "data_parallel_size", None),
            "virtual_pipeline_model_parallel_size": getattr(args, "virtual_pipeline_model_parallel_size", None)}
    for key in ("consumed_train_samples", "train_tokens", "final_loss", "seq_length"):
        value = ckpt.info.get(key, getattr(args, key, None))
        if isinstance(value, (int, float, str)):
            info[key] = value
    if "final_loss" not in info and isinstance(ckpt.info.get("loss"), (int, float)):
        info["final_loss"] = ckpt.info["loss"]  # what the training loop stores at each save
    return info


def reshard(src: str | os.PathLike, out: str | os.PathLike, tp: int = 1, pp: int = 1, vpp: int | None = None,
            verify: bool = False, ckpt_format: str = "torch", legacy_names: bool = False,
            training_state: Callable | None = None) -> dict[str, Any]:
    """Re-split model weights to a new layout; the output in Megatron's torch format (optionally
    with legacy names) or torch_dist.  Weights only, unless `training_state(ckpt, tp, pp, vpp)`
    is given: the carrier of optimizer, scheduler and RNG state (training/reshard_optimizer.py,
    a layer above this one), with `args` (run args to keep), `rank_entries(tp_rank, stage)`
    (entries of that rank file) and `write(iter_dir)` (its other files)."""
    check_output_format(ckpt_format, legacy_names, vpp)
    if training_state is not None and (ckpt_format != "torch" or legacy_names):
        raise ConfigError("--with-optimizer writes the torch format with megatron-core names (what training "
                          "resumes from); leave --ckpt-format torch_dist and --legacy-names out")
    ckpt = open_megatron(src)
    carry = training_state(ckpt, tp, pp, vpp) if training_state is not None else None
    names = ckpt.names()

    def source(layers):
        wanted = set(layers)
        for name in names:
            index = layer_index(name)
            if index is None or index in wanted:
                yield name, ckpt.get(name)

    extra = {k: v for k, v in ckpt.info.items()
             if k not in ("args", "checkpoint_version", "iteration", "opt_param_scheduler")}
    keep = {k: getattr(ckpt.args, k) for k in ("hf_generation_config", "consumed_train_samples",
                                                 "consumed_valid_samples", "seq_length") if hasattr(ckpt.args, k)}
    tokenizer_src = _megatron_tokenizer(src)
    keep["tokenizer"] = tokenizer_args(tokenizer_src, Path(out).absolute() / TOKENIZER_SUBDIR)
    if keep["tokenizer"]["tokenizer_type"] == "NullTokenizer":  # no files to copy: what the source named
        keep["tokenizer"] = {k: getattr(ckpt.args, k) for k in ("tokenizer_type", "tokenizer_model", "vocab_file",
                                                                 "merge_file") if getattr(ckpt.args, k, None)} \
            or keep["tokenizer"]
    if carry is not None:
        keep = {**carry.args, **keep}
    report: dict[str, Any] = {"out": str(out), "tp": tp, "pp": pp, "vpp": vpp, "iteration": ckpt.iteration}
    with _staged(out) as staging:
        iter_dir = staging.path / iter_dir_name(ckpt.iteration)
        _write_output(iter_dir, ckpt.config, source, tp, pp, vpp, ckpt.iteration, keep, extra, ckpt_format,
                      legacy_names, rank_extra=carry.rank_entries if carry is not None else None)
        if carry is not None:
            report["optimizer"] = carry.write(iter_dir)
        _carry_tokenizer(tokenizer_src, staging.path / TOKENIZER_SUBDIR)
        _finish_megatron(staging, ckpt.iteration)
        if verify:
            written = open_megatron(staging.path)
            tensors = compare_tensors(((name, written.get(name)) for name in written.names()), ckpt.get)
            ids = fixed_prompt(ckpt.config.vocab_size, ckpt.config.max_position_embeddings)
            report["verify"] = compare(megatron_logits(ckpt, ids), megatron_logits(written, ids), tensors=tensors)
        staging.commit()
    return report

"""Where a training run starts, decided before any model is built (Megatron-LM's rules).

    --load DIR with a checkpoint          resume: model, optimizer, LR schedule, RNG, data position
                                          (of the tracker's iteration, or --ckpt-step N's iter_N)
                                          (--finetune, or a `release` checkpoint: weights only, iteration 0;
                                          --no-load-optim / --no-load-rng drop those parts)
    --load = --save folder, no checkpoint a new run: --pretrained-checkpoint's weights (fine-tune,
                                          iteration 0), else --hf-model's / a fresh init
    --load anything else                  an error: a missing folder, an iter_* folder, a folder
                                          without latest_checkpointed_iteration.txt, and (unless
                                          --finetune) iter_* folders without it, even in --save
    --pretrained-checkpoint alone         fine-tune from it (a Megatron checkpoint of any layout, a
                                          converted weights-only one, an HF folder or a Hub id)

The model's structure comes from --hf-config / --hf-model when given, else from the checkpoint that
supplies the weights (its saved `args`, or the HF folder's config.json).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint.files import TRACKER, iter_dir_name, read_tracker
from ..config import ModelConfig
from ..errors import CheckpointError, ConfigError
from .config import RunConfig


@dataclass
class Start:
    """`kind`: "fresh" (new weights or --hf-model's), "resume" (the whole training state of
    `megatron_dir`), "finetune" (weights only: from `megatron_dir` or from the HF source `hf_source`)."""

    kind: str
    megatron_dir: Path | None = None
    hf_source: str | None = None
    iteration: int | None = None  # of megatron_dir to load (--ckpt-step); None: the tracker's

    @property
    def weights_from_megatron(self) -> bool:
        return self.megatron_dir is not None

    def iteration_to_load(self) -> int | str:
        """The iteration of megatron_dir a resume loads: --ckpt-step's, else the tracker's."""
        return self.iteration if self.iteration is not None else read_tracker(self.megatron_dir)


def _is_iteration_folder(path: Path) -> bool:
    return path.name == "release" or (path.name.startswith("iter_") and path.name[5:].isdigit())


def _same_folder(a: str | None, b: str | None) -> bool:
    return bool(a and b) and os.path.abspath(a) == os.path.abspath(b)


def _megatron_kind(folder: Path, finetune: bool) -> str:
    """A release checkpoint (what the converters write) is always loaded weights-only, as in Megatron-LM."""
    return "finetune" if finetune or read_tracker(folder) == "release" else "resume"


def _pretrained(source: str) -> Start:
    path = Path(source)
    if path.is_dir() and ((path / TRACKER).is_file() or _is_iteration_folder(path)):
        return Start("finetune", megatron_dir=path)
    if path.is_dir() and not (path / "config.json").is_file():
        raise CheckpointError(f"--pretrained-checkpoint {path}: neither a Megatron checkpoint (no {TRACKER}) nor an "
                              "HF folder (no config.json)")
    return Start("finetune", hf_source=source)  # an HF folder or a Hub id (checked when it is opened)


def _iteration_folders(load: Path) -> list[str]:
    return sorted(p.name for p in load.iterdir() if p.is_dir() and _is_iteration_folder(p)) if load.is_dir() else []


def _chosen_iteration(load: Path, step: int) -> int:
    """--ckpt-step N, as Megatron-LM: iter_N of --load instead of the tracker's iteration."""
    if not (load / iter_dir_name(step)).is_dir():
        found = [name for name in _iteration_folders(load) if name != "release"]
        raise CheckpointError(f"--ckpt-step {step}: {load} has no {iter_dir_name(step)}; its iterations: "
                              f"{', '.join(found) or 'none'}")
    return step


def _refuse_untracked_iterations(load: Path, run: RunConfig) -> None:
    """iter_* folders without the tracker: Megatron-LM warns "could not find the metadata file" and
    starts from random -- over them, when --save is the same folder.  Refused here, naming the fix."""
    found = _iteration_folders(load)
    if not found:
        return
    shown = ", ".join(found[:6]) + (f" and {len(found) - 6} more" if len(found) > 6 else "")
    last = found[-1] if found[-1] == "release" else int(found[-1][5:])
    overwrite = " (this run would save over them)" if _same_folder(run.load, run.save) else ""
    raise CheckpointError(f"--load {load}: holds {shown} but no {TRACKER}, so no checkpoint to resume{overwrite}; "
                          f"to resume, write the iteration into it (echo {last} > {load / TRACKER}); to start "
                          "afresh, remove them or give another --save and --load")


def plan_start(run: RunConfig) -> Start:
    """Apply the --load / --pretrained-checkpoint / --finetune rules (see the module docstring)."""
    if run.load:
        load = Path(run.load)
        if _is_iteration_folder(load):
            raise CheckpointError(f"--load {load}: an iteration folder; give the checkpoint folder that holds "
                                  f"{TRACKER} ({load.parent})")
        if (load / TRACKER).is_file():
            if run.ckpt_step is not None:
                return Start("finetune" if run.finetune else "resume", megatron_dir=load,
                             iteration=_chosen_iteration(load, run.ckpt_step))
            return Start(_megatron_kind(load, run.finetune), megatron_dir=load)
        if not run.finetune:
            _refuse_untracked_iterations(load, run)
        if run.exit_on_missing_checkpoint:
            raise CheckpointError(f"--load {load}: no checkpoint found (no {TRACKER}) and --exit-on-missing-checkpoint "
                                  "is set")
        if not _same_folder(run.load, run.save):
            what = "no such folder" if not load.exists() else f"not a Megatron checkpoint folder (no {TRACKER})"
            raise CheckpointError(f"--load {load}: {what}; a --load without a checkpoint is accepted only when it "
                                  "is this run's --save folder (a new run)")
    if run.ckpt_step is not None:
        raise ConfigError(f"--ckpt-step {run.ckpt_step}: expected --load DIR with a checkpoint to take that iteration "
                          "from")
    if run.pretrained_checkpoint:
        return _pretrained(run.pretrained_checkpoint)
    if run.finetune:
        raise ConfigError("--finetune: expected --load DIR with a checkpoint or --pretrained-checkpoint to take "
                          "the weights from")
    return Start("fresh")


def config_of_hf(source: str) -> ModelConfig:
    from ..conversion.hf_io import HFCheckpoint
    return ModelConfig.from_hf(HFCheckpoint(source).config)


def _config_of_hf_config_file(path_str: str) -> ModelConfig:
    from transformers import AutoConfig
    path = Path(path_str)
    if not path.exists():
        raise ConfigError(f"--hf-config {path}: no such file or folder")
    try:
        hf_config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        reason = str(exc).partition("\n")[0]
        raise ConfigError(f"--hf-config {path}: not a transformers config.json ({reason})") from None
    return ModelConfig.from_hf(hf_config)


def _config_of_model_flags(run: RunConfig) -> ModelConfig:
    from .model_flags import hf_config_of_flags
    from .tokenizer_files import tokenizer_source, vocab_size_of
    folder = tokenizer_source(run)
    return ModelConfig.from_hf(hf_config_of_flags(run, vocab_size_of(folder) if folder else None))


def model_source(run: RunConfig, start: Start) -> tuple[Any, ModelConfig]:
    """(what to build the model from, its ModelConfig).  The first is an HF folder / Hub id when its
    weights are the ones to train (a fresh run with --hf-model, or a fine-tune from an HF source),
    else a ModelConfig (weights then come from a Megatron checkpoint, or a Megatron-style init)."""
    if start.hf_source is not None:
        return start.hf_source, config_of_hf(start.hf_source)  # its own config.json gives the structure
    if run.hf_config or run.model_flags_given():
        config = _config_of_hf_config_file(run.hf_config) if run.hf_config else _config_of_model_flags(run)
        if start.megatron_dir is not None:  # Megatron-LM's check_checkpoint_args, for every defining value
            from ..checkpoint.load import open_megatron
            from .model_flags import check_flags_match_checkpoint
            check_flags_match_checkpoint(config, open_megatron(start.megatron_dir, start.iteration).config,
                                         start.megatron_dir, resume=start.kind == "resume",
                                         given_by=f"--hf-config {run.hf_config}" if run.hf_config else None)
    elif run.hf_model:
        config = config_of_hf(run.hf_model)
        if not start.weights_from_megatron:
            return run.hf_model, config
    elif start.megatron_dir is None:
        raise ConfigError(f"--load {run.load}: holds no checkpoint yet to take the model from; give --hf-model "
                          "or --hf-config for a new run")
    else:  # structure from the Megatron checkpoint's saved args
        from ..checkpoint.load import open_megatron
        config = open_megatron(start.megatron_dir, start.iteration).config
    return config, config

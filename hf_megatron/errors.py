"""The project's error type.

Every bad input a user can give (a config, a dataset, a checkpoint, a CLI flag) raises a
subclass of `HFMegatronError` with a one-line message naming the file or field and what was
expected.  The CLI prints exactly these as one line (exit status 2); any other exception is
our bug and keeps its traceback.
"""
from __future__ import annotations


class HFMegatronError(Exception):
    """A user-facing error: the message is one line naming the input and what was expected."""


class ConfigError(HFMegatronError, ValueError):
    """A model/training config we cannot use (unsupported architecture or field, bad value)."""


class CheckpointError(HFMegatronError, ValueError):
    """A checkpoint (HF folder, Megatron directory, torch_dist) we cannot read or write."""


class DataError(HFMegatronError, ValueError):
    """A dataset, data prefix or tokenizer we cannot use."""


class ParallelConfigError(HFMegatronError, ValueError):
    """Parallel degrees that do not fit the world size or the model."""


class DataNotFoundError(DataError, FileNotFoundError):
    """A dataset file, corpus input or tokenizer file that does not exist (still a FileNotFoundError)."""

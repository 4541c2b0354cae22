"""Config dataclass fields that carry their own flag, help, choices and bounds.

`option(...)` declares a field; `flag_of` names its Megatron-LM flag; `check_fields` checks every
field of a config against its metadata (one-line ConfigError naming the field and flag).  Used by
training/config.py and training/model_flags.py; commands/flags.py turns the fields into flags.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import MISSING, field
from typing import Any

from ..errors import ConfigError

BOUNDS = (("at_least", ">=", operator.ge), ("above", ">", operator.gt), ("below", "<", operator.lt))


def option(default: Any = MISSING, *, help: str, group: str, choices: tuple | None = None,
           at_least: float | None = None, above: float | None = None, below: float | None = None,
           cli_required: bool = False, aliases: tuple[str, ...] = (), off_switch: str | None = None):
    """A dataclass field with what the CLI and the checks need to know about it.

    `at_least` / `above` / `below`: bounds (>=, >, <) checked by `check_fields`; None values are
    not checked (they mean "unset").  `cli_required`: the flag must be given on the command line
    even though Python callers get the default.  `aliases`: more flag spellings (Megatron-LM's own,
    e.g. --override-opt_param-scheduler).  `off_switch`: a bool's Megatron-LM flag that turns it off
    (e.g. --no-gradient-accumulation-fusion), accepted so Megatron-LM command lines run unchanged."""
    metadata = {"help": help, "group": group, "choices": choices, "at_least": at_least, "above": above,
                "below": below, "cli_required": cli_required, "aliases": aliases, "off_switch": off_switch}
    return field(default=default, metadata=metadata)


def flag_of(name: str) -> str:
    """Megatron-LM's flag for a field: `lr_warmup_iters` -> `--lr-warmup-iters`."""
    return "--" + name.replace("_", "-")


def _fail(config, name: str, expected: str, value: Any) -> None:
    raise ConfigError(f"{type(config).__name__}.{name} ({flag_of(name)}): expected {expected}, got {value!r}")


def check_fields(config) -> None:
    """Check every field against its metadata's choices and bounds (one-line ConfigError)."""
    for f in dataclasses.fields(config):
        value, meta = getattr(config, f.name), f.metadata
        if value is None and "None" not in str(f.type):  # annotations are strings here
            _fail(config, f.name, "a value (this field cannot be unset)", value)
        if f.type == "bool" and not isinstance(value, bool):
            _fail(config, f.name, "True or False", value)
        if value is None or isinstance(value, bool):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            _fail(config, f.name, "a finite number", value)
        if meta.get("choices") and value not in meta["choices"]:
            _fail(config, f.name, f"one of {', '.join(meta['choices'])}", value)
        bounds = [(meta[key], symbol, test) for key, symbol, test in BOUNDS if meta.get(key) is not None]
        try:
            ok = all(test(value, bound) for bound, _, test in bounds)
        except TypeError:  # e.g. a string from a YAML file
            ok = False
        if not ok:
            _fail(config, f.name, "a number " + " and ".join(f"{symbol} {bound}" for bound, symbol, _ in bounds), value)

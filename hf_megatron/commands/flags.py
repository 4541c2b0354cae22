"""Command-line flags generated from config dataclasses, so every option is written once.

Each field declared with `training.config.option(...)` becomes Megatron-LM's flag
`--field-name-with-dashes` in its `group`: the type comes from the annotation (`int | None` ->
int, `list[str]` -> one or more values), a bool is a `store_true` switch, the help text shows
the choices and the default.  Values are not checked here: the dataclass's `__post_init__` does
that, for the CLI and for Python callers alike.
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from ..training.config import flag_of

METAVARS = {int: "N", float: "X"}  # strings keep argparse's FIELD_NAME


def _value_type(annotation) -> tuple[type, bool]:
    """(element type, is a list) of `int`, `float | None`, `list[str]`, ..."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is list:
        return typing.get_args(annotation)[0], True
    return annotation, False


def add_flags(parser: argparse.ArgumentParser, *config_classes: type) -> None:
    """One flag per field of `config_classes`, in argument groups named by the fields' metadata."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for cls in config_classes:
        hints = typing.get_type_hints(cls)
        own = cls.__dict__.get("__annotations__", {})  # a class's own fields first, then inherited ones
        for f in sorted(dataclasses.fields(cls), key=lambda f: f.name not in own):
            meta = f.metadata
            if meta["group"] not in groups:
                groups[meta["group"]] = parser.add_argument_group(meta["group"])
            kind, is_list = _value_type(hints[f.name])
            kwargs: dict = {"dest": f.name, "help": meta["help"].replace("%", "%%")}
            required = f.default is dataclasses.MISSING or meta["cli_required"]
            if kind is bool:
                # a switch: off by default, or None = decided at run time (then its off_switch sets False)
                assert f.default is False or (f.default is None and meta.get("off_switch")), \
                    f"{cls.__name__}.{f.name}: a CLI switch must default to False (or None, with an off switch)"
                kwargs.update(action="store_const", const=True, default=f.default)
            else:
                kwargs.update(type=kind, required=required)
                if not required:
                    kwargs["default"] = f.default
                if is_list:
                    kwargs["nargs"] = "+"
                kwargs["metavar"] = "{" + ",".join(meta["choices"]) + "}" if meta["choices"] else METAVARS.get(kind)
                if not required and f.default is not None and "(default" not in meta["help"]:
                    kwargs["help"] += f" (default: {f.default})"
            groups[meta["group"]].add_argument(*meta.get("aliases", ()), flag_of(f.name), **kwargs)
            if meta.get("off_switch"):  # Megatron-LM's negative spelling of a switch: sets it False
                groups[meta["group"]].add_argument(
                    meta["off_switch"], dest=f.name, action="store_const", const=False, default=f.default,
                    help=f"turn {flag_of(f.name)} off" + (" (the default)" if f.default is False else ""))


def add_megatron_lm_no_ops(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM flags that pick among implementations hf-megatron has one of, accepted and ignored:
    they change no number here.  --attention-softmax-in-fp32 asks for a precision hf-megatron always
    has: scaled_dot_product_attention's kernels keep the softmax in fp32 for bf16/fp16 inputs, and
    torch's softmax of a bf16/fp16 tensor computes in fp32 and rounds once, as Megatron-LM's fp32
    softmax followed by its cast back (tests/test_attention_softmax_fp32.py)."""
    group = parser.add_argument_group("Megatron-LM flags accepted with no effect (hf-megatron has one "
                                      "implementation)")
    group.add_argument("--use-mcore-models", action="store_true", dest="_use_mcore_models",
                       help="megatron-core's GPTModel: the model is always built under its names")
    group.add_argument("--transformer-impl", choices=("local",), dest="_transformer_impl",
                       help="megatron-core's local layers (Transformer Engine's are not supported)")
    group.add_argument("--auto-detect-ckpt-format", action="store_true", dest="_auto_detect_ckpt_format",
                       help="--load always detects the checkpoint's format (torch or torch_dist)")
    group.add_argument("--no-masked-softmax-fusion", action="store_true", dest="_no_masked_softmax_fusion",
                       help="hf-megatron has no fused masked-softmax kernel to turn off")
    group.add_argument("--attention-softmax-in-fp32", action="store_true", dest="_attention_softmax_in_fp32",
                       help="the attention softmax is always computed in fp32 here (then rounded to the "
                            "activations' dtype, as Megatron-LM does)")


def unrecognized(tokens: list[str]) -> str:
    """argparse's "unrecognized arguments" message, saying which of them are Megatron-LM's flags."""
    from .megatron_lm_flags import MEGATRON_LM_FLAGS
    megatron = [t.split("=")[0] for t in tokens if t.startswith("--") and t.split("=")[0][2:] in MEGATRON_LM_FLAGS]
    message = f"unrecognized arguments: {' '.join(tokens)}"
    if megatron:
        message += (f" (Megatron-LM's {', '.join(megatron)} {'is' if len(megatron) == 1 else 'are'} not supported "
                    "by hf-megatron)")
    return message


def unknown_megatron_lm_flags(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """The flags in `argv` that `parser` does not take, where one of them is Megatron-LM's (found
    before argparse's own checks, so a missing --data-path is not reported first for --mock-data)."""
    from .megatron_lm_flags import MEGATRON_LM_FLAGS
    unknown = [t for t in argv if t.startswith("--") and len(t) > 2
               and t.split("=")[0] not in parser._option_string_actions]
    return unknown if any(t.split("=")[0][2:] in MEGATRON_LM_FLAGS for t in unknown) else []


def configs_from_args(args: argparse.Namespace, *config_classes: type) -> list:
    """The parsed flags back into one instance of each config class (validated by its __post_init__)."""
    return [cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.init})
            for cls in config_classes]

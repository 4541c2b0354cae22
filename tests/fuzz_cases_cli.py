"""Fuzz cases for command-line flags (no tests here): every numeric / choice flag of `train`
(generated from the config dataclasses' bounds, as the flags themselves are), and the flags of
`convert`, `reshard` and `preprocess`."""
from __future__ import annotations

import dataclasses
import errno
import typing

from fuzz_bases import Bases
from fuzz_harness import Case, cli
from hf_megatron.commands.flags import _value_type
from hf_megatron.training.config import RunConfig, TrainingConfig, flag_of


def _violations(meta: dict, kind: type) -> list[str]:
    """Values outside a field's bounds, and values of the wrong kind."""
    values = []
    if meta.get("at_least") is not None:
        values.append(str(kind(meta["at_least"]) - 1))
    if meta.get("above") is not None:
        values += [str(kind(meta["above"])), str(kind(meta["above"]) - 1)]
    if meta.get("below") is not None:
        values += [str(kind(meta["below"])), str(kind(meta["below"]) + 1)]
    values += ["abc", ""]
    if kind is int:
        values.append("1.5")
    if kind is float:
        values += ["nan", "inf", "-inf"]
    return list(dict.fromkeys(values))


def train_cases(b: Bases) -> list[Case]:
    base = ["train", "--hf-config", b.llama / "config.json", "--data-path", b.data, "--train-iters", "1"]
    cases = []
    for cls in (TrainingConfig, RunConfig):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind, is_list = _value_type(hints[f.name])
            flag = flag_of(f.name)
            if kind in (int, float) and not is_list:
                values = _violations(f.metadata, kind)
            elif f.metadata.get("choices"):
                values = ["bogus"]
            else:
                continue
            for value in values:
                argv = [a for a in base if a != "--train-iters" and a != "1"] if flag == "--train-iters" else list(base)
                cases.append(Case("CLI flags", f"train {flag} {value!r}",
                                  lambda w, argv=argv + [flag, value]: cli(argv + ["--save", w / "ckpt"]), flag))
    cases += [Case("CLI flags", "train unknown flag", lambda w: cli(base + ["--no-such-flag"]), "--no-such-flag"),
              Case("CLI flags", "train without --data-path", lambda w: cli(base[:3] + ["--train-iters", "1"]), "--data-path"),
              Case("CLI flags", "train --hf-config missing file", lambda w: cli(
                  ["train", "--hf-config", w / "none.json", "--data-path", b.data, "--train-iters", "1"]), "none.json"),
              Case("CLI flags", "train --data-path missing", lambda w: cli(
                  ["train", "--hf-config", b.llama / "config.json", "--data-path", w / "nodata", "--train-iters", "1"]),
                   "nodata")]
    return cases


def converter_cases(b: Bases) -> list[Case]:
    cat = "CLI flags"
    to_meg = lambda w, *flags: cli(["convert", "hf-to-megatron", "--hf", b.llama, "--out", w / "out", *flags])  # noqa: E731
    to_hf = lambda w, *flags: cli(["convert", "megatron-to-hf", "--megatron", b.meg_llama, "--out", w / "out", *flags])  # noqa: E731
    reshard = lambda w, *flags: cli(["reshard", "--src", b.meg_llama, "--out", w / "out", *flags])  # noqa: E731
    cases = []
    for name, run in (("hf-to-megatron", to_meg), ("reshard", reshard)):
        for flag, value in [("--tp", "0"), ("--tp", "-1"), ("--tp", "abc"), ("--tp", "3"), ("--tp", "8"),
                            ("--pp", "0"), ("--pp", "-2"), ("--pp", "3"), ("--pp", "1.5"), ("--vpp", "0"),
                            ("--vpp", "2"), ("--vpp", "-1")]:
            cases.append(Case(cat, f"{name} {flag} {value}", lambda w, run=run, f=flag, v=value: run(w, f, v),
                              None if value in ("3", "8", "2") else flag))
    cases += [Case(cat, f"hf-to-megatron --dtype {v}", lambda w, v=v: to_meg(w, "--dtype", v), "--dtype")
              for v in ("fp8", "int8", "", "FP32x")]
    cases += [Case(cat, f"megatron-to-hf --dtype {v}", lambda w, v=v: to_hf(w, "--dtype", v), "--dtype") for v in ("fp64", "x")]
    cases += [Case(cat, f"megatron-to-hf --max-shard-size {v!r}", lambda w, v=v: to_hf(w, "--max-shard-size", v),
                   "--max-shard-size") for v in ("5XB", "abc", "", "-5GB", "5 G B")]
    cases += [Case(cat, f"megatron-to-hf --vocab-size {v}", lambda w, v=v: to_hf(w, "--vocab-size", v), "--vocab-size")
              for v in ("0", "-1", "abc", "299")]
    cases += [Case(cat, "megatron-to-hf --tokenizer missing", lambda w: to_hf(w, "--tokenizer", w / "notok"), "notok"),
              Case(cat, "hf-to-megatron --out is a file", lambda w: (w.joinpath("f").write_text("x"),
                                                                     cli(["convert", "hf-to-megatron", "--hf", b.llama,
                                                                          "--out", w / "f"]))[1], "f"),
              Case(cat, "hf-to-megatron without --out", lambda w: cli(["convert", "hf-to-megatron", "--hf", b.llama]), "--out"),
              Case(cat, "convert without a direction", lambda w: cli(["convert"]), "direction"),
              Case(cat, "reshard --src missing", lambda w: cli(["reshard", "--src", w / "none", "--out", w / "o"]), "none")]
    prep = lambda w, *flags: cli(["preprocess", "--input", b.jsonl, "--output-prefix", w / "out", "--no-progress", *flags])  # noqa: E731
    hf_tok = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(b.llama)]
    cases += [Case(cat, f"preprocess {f} {v}", lambda w, f=f, v=v: prep(w, *hf_tok, f, v), f)
              for f in ("--workers", "--partitions") for v in ("0", "-1", "abc")]
    cases += [Case(cat, "preprocess NullTokenizer --vocab-size 0", lambda w: prep(w, "--tokenizer-type", "NullTokenizer",
                                                                                 "--vocab-size", "0"), "--vocab-size"),
              Case(cat, "preprocess NullTokenizer --vocab-size -5", lambda w: prep(w, "--tokenizer-type", "NullTokenizer",
                                                                                  "--vocab-size", "-5"), "--vocab-size"),
              Case(cat, "preprocess --tokenizer-type bogus", lambda w: prep(w, "--tokenizer-type", "bogus"), "--tokenizer-type"),
              Case(cat, "preprocess --json-keys missing field", lambda w: prep(w, *hf_tok, "--json-keys", "nope"), "nope")]
    return cases


def _disk_full(target: str, run):
    """`run(workdir)` while `target` (a writer the converters use) fails as on a full disk."""
    def case(workdir):
        from unittest import mock

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device", str(workdir / "out"))
        with mock.patch(target, full):
            result = run(workdir)
        leftovers = [p.name for p in workdir.iterdir() if p.name.startswith(".out")]
        assert not leftovers and not (workdir / "out").exists(), leftovers  # nothing half-written left
        return result
    return case


def output_cases(b: Bases) -> list[Case]:
    cat = "CLI flags"
    runs = {"hf-to-megatron": lambda w, out: cli(["convert", "hf-to-megatron", "--hf", b.llama, "--out", out]),
            "megatron-to-hf": lambda w, out: cli(["convert", "megatron-to-hf", "--megatron", b.meg_llama, "--out", out]),
            "reshard": lambda w, out: cli(["reshard", "--src", b.meg_llama, "--out", out])}
    cases = []
    for name, run in runs.items():
        cases.append(Case(cat, f"{name} --out under a file", lambda w, run=run: (
            w.joinpath("file").write_text("x"), run(w, w / "file" / "out"))[1], "cannot write"))
        writer = "safetensors.torch.save_file" if name == "megatron-to-hf" else "torch.save"
        cases.append(Case(cat, f"{name} on a full disk", _disk_full(writer, lambda w, run=run: run(w, w / "out")),
                          "No space left on device"))
    return cases


def cli_cases(b: Bases) -> list[Case]:
    return train_cases(b) + converter_cases(b) + output_cases(b)

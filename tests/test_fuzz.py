"""The project's own fuzz corpus: generated bad inputs across data, config.json, safetensors,
Megatron rank files, torch_dist checkpoints, tokenizer files and CLI flags.  Each must end in the
project's one-line error (no traceback, no silent acceptance, no hang); the count per category
is printed.  Most run in this process through the CLI's `main` or the library call (the CLI
prints exactly these errors as its one line); `test_fuzz_sample_in_subprocesses` runs a sample
through the installed command line."""
from __future__ import annotations

import pytest

from fuzz_bases import build_bases
from fuzz_cases_checkpoints import checkpoint_cases
from fuzz_cases_cli import cli_cases
from fuzz_cases_data import data_cases
from fuzz_harness import SUBPROCESS, run_corpus

MIN_CASES = 300


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    return build_bases(tmp_path_factory.mktemp("fuzz_bases"))


def all_cases(b):
    return data_cases(b) + checkpoint_cases(b) + cli_cases(b)


def test_fuzz_corpus(bases, tmp_path, capsys):
    cases = all_cases(bases)
    counts, failures = run_corpus(cases, tmp_path)
    with capsys.disabled():
        print("\nfuzz corpus: " + ", ".join(f"{cat} {n}" for cat, n in counts.items()) + f"; total {len(cases)}, "
              f"{len(cases) - len(failures)} one-line errors, {len(failures)} failures")
    assert not failures, "\n".join(failures)
    assert len(cases) >= MIN_CASES


def _sample(cases, per_category: int):
    seen: dict[str, int] = {}
    out = []
    for case in cases:
        if seen.get(case.category, 0) < per_category:
            seen[case.category] = seen.get(case.category, 0) + 1
            out.append(case)
    return out


def _run_in_subprocesses(cases, root, capsys):
    SUBPROCESS["on"] = True
    try:
        counts, failures = run_corpus(cases, root)
    finally:
        SUBPROCESS["on"] = False
    with capsys.disabled():
        print(f"\nfuzz sample through `python -m hf_megatron.cli`: {len(cases)} cases, {len(failures)} failures")
    assert not failures, "\n".join(failures)


def test_fuzz_sample_in_subprocesses(bases, tmp_path, capsys):
    """The command line's own process prints the same one line (one case in the default run: each
    process start imports torch and transformers; --runslow runs three per category)."""
    cases = [c for c in all_cases(bases) if c.name == "rank 1 lacks decoder.layers.0.mlp.linear_fc1.weight"]
    assert len(cases) == 1
    _run_in_subprocesses(cases, tmp_path, capsys)


@pytest.mark.slow
def test_fuzz_sample_per_category_in_subprocesses(bases, tmp_path, capsys):
    _run_in_subprocesses(_sample(all_cases(bases), 3), tmp_path, capsys)

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
from fuzz_cases_data import data_cases
from fuzz_harness import run_corpus

MIN_CASES = 300


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    return build_bases(tmp_path_factory.mktemp("fuzz_bases"))


def all_cases(b):
    return data_cases(b) + checkpoint_cases(b)


def test_fuzz_corpus(bases, tmp_path, capsys):
    cases = all_cases(bases)
    counts, failures = run_corpus(cases, tmp_path)
    with capsys.disabled():
        print("\nfuzz corpus: " + ", ".join(f"{cat} {n}" for cat, n in counts.items()) + f"; total {len(cases)}, "
              f"{len(cases) - len(failures)} one-line errors, {len(failures)} failures")
    assert not failures, "\n".join(failures)
    assert len(cases) >= MIN_CASES

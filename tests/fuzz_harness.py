"""The fuzz corpus's harness (no tests here): a bad input is a `Case` whose `run(workdir)` builds
the input inside `workdir` and hands it to one of the project's entry points -- the CLI's
`main(argv)` in this process (its error path is the one the installed command takes), or a
library call (from_pretrained, load_megatron_weights, IndexedDataset, build_gpt_datasets).

A case passes only when the entry point ends in the project's one-line error:
  library   an HFMegatronError whose message is one non-empty line naming `mention`
  CLI       exit status 2 and a last stderr line `hf-megatron <verb>: error: ...` naming
            `mention` (argparse's own rejections, usage line + that line, count as well)
Anything else fails the case: any other exception (a traceback), success (silent acceptance),
or running past TIMEOUT_S (a hang, cut by SIGALRM).
"""
from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hf_megatron.errors import HFMegatronError

TIMEOUT_S = 30  # generous: a loaded 2-core CI machine; a real hang runs forever


@dataclass
class Cli:
    """What a CLI call left: exit status and stderr."""
    rc: int
    err: str


@dataclass(frozen=True)
class Case:
    category: str
    name: str
    run: Callable[[Path], object]  # raises HFMegatronError, or returns a Cli
    mention: str | None = None     # a fragment the error line must contain (file or field)


class Hang(Exception):
    pass


SUBPROCESS = {"on": False}  # run `cli` cases as `python -m hf_megatron.cli` processes instead
REPO = Path(__file__).resolve().parents[1]


def cli(argv: list[str]) -> Cli:
    """`hf-megatron <argv>` in this process (stderr captured), or in its own process."""
    if SUBPROCESS["on"]:
        env = {**os.environ, "HF_HUB_OFFLINE": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        try:
            done = subprocess.run([sys.executable, "-m", "hf_megatron.cli", *map(str, argv)], capture_output=True,
                                  text=True, env=env, timeout=TIMEOUT_S * 4)
        except subprocess.TimeoutExpired:
            raise Hang() from None
        return Cli(done.returncode, done.stderr)
    from hf_megatron.cli import main
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main([str(a) for a in argv])
        except SystemExit as exc:  # argparse's rejections
            rc = exc.code if isinstance(exc.code, int) else 1
    return Cli(rc, err.getvalue())


def _alarm(signum, frame):
    raise Hang()


def failure(case: Case, workdir: Path) -> str | None:
    """None when the case ends in the project's one-line error; else what went wrong."""
    previous = signal.signal(signal.SIGALRM, _alarm)
    limit = TIMEOUT_S * 4 + 5 if SUBPROCESS["on"] else TIMEOUT_S  # a process start imports torch first
    signal.alarm(limit)
    try:
        result = case.run(workdir)
    except Hang:
        return f"hang: still running after {limit}s"
    except HFMegatronError as exc:
        message = str(exc)
        if not message.strip() or "\n" in message.strip():
            return f"not one line: {message!r}"
        if case.mention and case.mention not in message:
            return f"does not name {case.mention!r}: {message}"
        return None
    except BaseException as exc:  # noqa: BLE001 -- every other exception is a finding
        return "traceback: " + "".join(traceback.format_exception_only(exc)).strip().splitlines()[-1][:300]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    if not isinstance(result, Cli):
        return "silently accepted"
    lines = [line for line in result.err.splitlines() if line.strip()]
    if result.rc == 0:
        return "silently accepted (exit 0)"
    if any("Traceback" in line for line in lines):
        return "traceback: " + (lines[-1] if lines else "")
    last = lines[-1] if lines else ""
    if result.rc != 2 or not (last.startswith("hf-megatron") and ": error: " in last):
        return f"exit {result.rc}, stderr ends {last[:300]!r}"
    if case.mention and case.mention not in last:
        return f"does not name {case.mention!r}: {last}"
    return None


def run_corpus(cases: list[Case], root: Path) -> tuple[dict[str, int], list[str]]:
    """(cases per category, failures as 'category/name: what')."""
    counts: dict[str, int] = {}
    failures = []
    for index, case in enumerate(cases):
        counts[case.category] = counts.get(case.category, 0) + 1
        workdir = root / f"{index:04d}"
        workdir.mkdir(parents=True)
        problem = failure(case, workdir)
        if problem:
            failures.append(f"{case.category}/{case.name}: {problem}")
    return counts, failures

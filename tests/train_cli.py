"""Running `hf-megatron train` as a user does, for the training-CLI tests.

`cli_subprocess(...)` runs `python -m hf_megatron.cli train ...` in a fresh process (what a user
types); `cli_inprocess(...)` calls the same entry point, `hf_megatron.cli.main`, in this process,
so a test that needs many short runs pays the interpreter and import start-up once.  Both return
(exit status, stdout, stderr).  `workspace(root)` writes a 200-document corpus and a tiny Llama
config.json there."""
from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys

import numpy as np
import torch

from hf_megatron import cli
from hf_megatron.data import IndexedDatasetWriter
from hf_megatron.parallel import state
from tiny import VOCAB, tiny_config


def make_workspace(root, documents: int = 200):
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(str(root / "corpus_text_document"), dtype=np.uint16) as writer:
        for _ in range(documents):
            writer.add_item(rng.integers(1, VOCAB, size=int(rng.integers(20, 80))))
            writer.end_document()
    tiny_config("llama").save_pretrained(root / "config")
    return root


def base_args(root, iters, *extra, config=True, split="90,10,0"):
    """A short run on the workspace's corpus (4 samples of 32 tokens per step); iters=None leaves
    --train-iters out."""
    model = ["--hf-config", root / "config"] if config else []
    steps = ["--train-iters", iters] if iters is not None else []
    return [*model, "--data-path", root / "corpus_text_document", "--split", split, "--seq-length", 32,
            "--micro-batch-size", 2, "--global-batch-size", 4, *steps, "--lr", 1e-3, "--log-interval", 1, *extra]


def env():
    """This tree first on the path (the venv may hold an editable install of another checkout)."""
    tree = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # one thread, as cli_inprocess: results are then bitwise the same in either kind of run
    return {**os.environ, "PYTHONPATH": os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}


def cli_subprocess(*args, timeout=300):
    result = subprocess.run([sys.executable, "-m", "hf_megatron.cli", "train", *map(str, args)],
                            capture_output=True, text=True, timeout=timeout, env=env())
    return result.returncode, result.stdout, result.stderr


def cli_inprocess(*args):
    out, err = io.StringIO(), io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(["train", *map(str, args)])
            except SystemExit as exc:  # argparse
                code = exc.code
    finally:
        state.reset()
        torch.set_num_threads(threads)
    return code, out.getvalue(), err.getvalue()


def learning_rates(out: str) -> list[str]:
    """The learning rate of each training log line (the monitor's `learning rate: X`), as %.3e."""
    return [f"{float(line.split('| learning rate: ')[1].split(' ')[0]):.3e}" for line in out.splitlines()
            if "| learning rate: " in line]


def error_line(result) -> str:
    """The one-line `hf-megatron train: error:` of a refused run (exit status 2, no traceback)."""
    code, _, err = result
    assert code == 2 and "Traceback" not in err, err[-2000:]
    line = last_line(err)
    assert line.startswith("hf-megatron train: error:") and len(err.strip().splitlines()) == 1, err
    return line


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def weights(folder, iteration):
    from hf_megatron.checkpoint.unpickle import safe_load
    path = folder / f"iter_{iteration:07d}" / "mp_rank_00" / "model_optim_rng.pt"
    return safe_load(path)["model"]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        if isinstance(a[name], torch.Tensor):
            assert torch.equal(a[name], b[name]), name

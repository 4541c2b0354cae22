"""A conversion stopped by SIGTERM or SIGHUP (a `kill`, a job scheduler, a closed terminal) cleans up its
hidden staging folder as Ctrl-C does: neither `out` nor `.out.partial-*` is left (SIGKILL may leave the
latter, never the former; tests/test_convert_cli.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from test_convert_helpers import save_hf

# the child converts with its second rank-file save held up, so the signal lands mid-conversion
CHILD = """
import sys, time
import hf_megatron.checkpoint.writer as writer
from hf_megatron.cli import main
real, saves = writer.torch.save, []
def slow_save(obj, path):
    saves.append(path)
    if len(saves) == 2:
        print("writing", flush=True)
        time.sleep(60)
    real(obj, path)
writer.torch.save = slow_save
sys.exit(main(["convert", "hf-to-megatron", "--hf", sys.argv[1], "--out", sys.argv[2], "--tp", "2"]))
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_terminated_conversion_leaves_nothing(sig, tmp_path):
    src = save_hf(tmp_path / "hf", "llama")
    out = tmp_path / "runs" / "meg"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(src), str(out)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        assert child.stdout.readline().strip() == "writing"
        assert [p.name for p in out.parent.iterdir() if p.name.startswith(".meg.partial-")]  # mid-way
        child.send_signal(sig)
        child.wait(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 128 + sig
    assert list(out.parent.iterdir()) == []

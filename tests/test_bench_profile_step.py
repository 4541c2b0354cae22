"""bench/profile_step.py's CPU dry run: each variant profiled in its own child process, the table of both."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASE = [sys.executable, str(ROOT / "bench" / "profile_step.py"), "--device", "cpu", "--tiny", "--model", "llama-1b",
        "--steps", "1", "--warmup", "1", "--top", "3"]


@pytest.mark.slow
def test_profile_step_dry_run_profiles_each_variant_in_a_child(tmp_path):
    done = subprocess.run(BASE + ["--variants", "hf-eager", "ours", "--breakdown", "matmul"], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| | hf-eager | ours |" in done.stdout and "ours top kernels in matmul" in done.stdout
    wall = next(line for line in done.stdout.splitlines() if line.startswith("| wall |"))
    assert all(float(cell) > 0 for cell in wall.strip("|").split("|")[1:])
    failed = subprocess.run(BASE + ["--variants", "ours-float8"], capture_output=True, text=True, timeout=600)
    assert failed.returncode != 0
    assert "the child profiling ours-float8 exited" in failed.stderr and "--fp8-format" in failed.stderr

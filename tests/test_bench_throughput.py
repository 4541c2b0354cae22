"""Smoke test of bench/throughput.py's CPU dry run (eager variants; the compiled ones are in test_compile)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_throughput_bench_dry_run(tmp_path):
    out = tmp_path / "r.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "throughput.py"), "--device", "cpu", "--tiny",
                    "--variants", "hf-eager", "ours", "--out", str(out)], check=True, capture_output=True, timeout=600)
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 6 and not [r for r in rows if "error" in r]
    assert all(r["tokens_per_s"] > 0 and r["vs_best_hf"] > 0 for r in rows)

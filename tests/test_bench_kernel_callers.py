"""bench/kernel_callers.py's CPU dry run: the ops behind a kernel name, with their input shapes."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


@pytest.mark.slow
def test_kernel_callers_dry_run_finds_the_bias_gradient_sums():
    import throughput
    spec = throughput.spec_of("gpt2-xl", tiny=True)
    config = throughput.hf_config(spec)  # transformers' GPT2Config: the widths the bias gradients must have
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_callers.py"), "--device", "cpu", "--tiny",
                           "--model", "gpt2-xl", "--variant", "ours", "--warmup", "1", "--kernel", "sum"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {}
    for line in done.stdout.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) == 5 and cells[2] == "aten::sum":
            rows[cells[3].split("]")[0] + "]]"] = int(cells[1])
    tokens = spec.batch * spec.seq
    # one launch per layer for the MLP's up projection bias (4 x hidden) and the fused qkv bias (3 x hidden)
    assert rows.get(f"[[{tokens}, {4 * config.n_embd}]]") == config.n_layer, done.stdout
    assert rows.get(f"[[{tokens}, {3 * config.n_embd}]]") == config.n_layer, done.stdout

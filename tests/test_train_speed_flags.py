"""`hf-megatron train --cross-entropy-loss-fusion --torch-compile --gradient-accumulation-fusion
--use-precision-aware-optimizer`: the
speed options change how the step is computed, not what: the same losses as the plain run (fp32, CPU;
compile, the chunked loss and the fused weight-gradient GEMM reorder float sums, hence rel 1e-5 and not
bit equality)."""
import json
import subprocess
import sys

import numpy as np
import pytest

from hf_megatron.data import IndexedDatasetWriter
from tiny import VOCAB, tiny_config


def _train(root, save, *extra):
    return subprocess.run(
        [sys.executable, "-m", "hf_megatron.cli", "train", "--hf-config", str(root / "config"),
         "--data-path", str(root / "corpus_text_document"), "--split", "100,0,0", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3",
         "--log-interval", "1", "--save", str(save), *extra], capture_output=True, text=True, timeout=600)


def test_speed_flags_train_the_same_losses(tmp_path):
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(str(tmp_path / "corpus_text_document"), dtype=np.uint16) as writer:
        for _ in range(60):
            writer.add_item(rng.integers(1, VOCAB, size=int(rng.integers(20, 80))))
            writer.end_document()
    tiny_config("llama").save_pretrained(tmp_path / "config")
    plain = _train(tmp_path, tmp_path / "plain")
    assert plain.returncode == 0, plain.stderr[-2000:]
    fast = _train(tmp_path, tmp_path / "fast", "--cross-entropy-loss-fusion", "--torch-compile",
                  "--gradient-accumulation-fusion", "--use-precision-aware-optimizer")
    assert fast.returncode == 0, fast.stderr[-2000:]
    assert "--use-precision-aware-optimizer: csrc's AdamW needs CUDA tensors" in fast.stderr  # CPU: torch's AdamW
    a = json.loads((tmp_path / "plain" / "training_summary.json").read_text())
    b = json.loads((tmp_path / "fast" / "training_summary.json").read_text())
    assert a["iterations"] == b["iterations"] == 3
    assert b["first_loss"] == pytest.approx(a["first_loss"], rel=1e-5)
    assert b["final_loss"] == pytest.approx(a["final_loss"], rel=1e-5)

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
import torch

from hf_megatron.data import IndexedDatasetWriter
from tiny import VOCAB, tiny_config


def _train(root, save, *extra):
    return subprocess.run(
        [sys.executable, "-m", "hf_megatron.cli", "train", "--hf-config", str(root / "config"),
         "--data-path", str(root / "corpus_text_document"), "--split", "100,0,0", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3",
         "--log-interval", "1", "--save", str(save), *extra], capture_output=True, text=True, timeout=600)


def _corpus(tmp_path):
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(str(tmp_path / "corpus_text_document"), dtype=np.uint16) as writer:
        for _ in range(60):
            writer.add_item(rng.integers(1, VOCAB, size=int(rng.integers(20, 80))))
            writer.end_document()
    tiny_config("llama").save_pretrained(tmp_path / "config")


def test_speed_flags_train_the_same_losses(tmp_path):
    _corpus(tmp_path)
    plain = _train(tmp_path, tmp_path / "plain")
    assert plain.returncode == 0, plain.stderr[-2000:]
    fast = _train(tmp_path, tmp_path / "fast", "--cross-entropy-loss-fusion", "--torch-compile",
                  "--gradient-accumulation-fusion", "--use-precision-aware-optimizer")
    assert fast.returncode == 0, fast.stderr[-2000:]
    assert "--use-precision-aware-optimizer: csrc's AdamW needs CUDA tensors" in fast.stderr  # CPU: torch's AdamW
    a = json.loads((tmp_path / "plain" / "training_summary.json").read_text())
    b = json.loads((tmp_path / "fast" / "training_summary.json").read_text())
    assert a["iterations"] == b["iterations"] == 3
    assert (a["torch_compile"], b["torch_compile"]) == (None, "layer")  # CPU: compiled only when asked
    assert b["first_loss"] == pytest.approx(a["first_loss"], rel=1e-5)
    assert b["final_loss"] == pytest.approx(a["final_loss"], rel=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_train_on_cuda_compiles_by_default_with_the_eager_losses(tmp_path):
    """On a CUDA GPU `hf-megatron train` compiles each layer unless --no-torch-compile; fp32, so the two
    runs differ only by inductor's reordered sums (rel 1e-4 over 3 steps)."""
    _corpus(tmp_path)
    runs = {name: _train(tmp_path, tmp_path / name, *flags)
            for name, flags in (("default", ()), ("eager", ("--no-torch-compile",)))}
    for run in runs.values():
        assert run.returncode == 0, run.stderr[-2000:]
    default, eager = (json.loads((tmp_path / n / "training_summary.json").read_text()) for n in runs)
    assert (default["torch_compile"], eager["torch_compile"]) == ("layer", None)
    assert default["final_loss"] == pytest.approx(eager["final_loss"], rel=1e-4)
    assert default["first_loss"] == pytest.approx(eager["first_loss"], rel=1e-4)

"""bench/loss_curves.py's harness on CPU (tiny config): the same init and data give the same curve
twice, the text stream is not flat, an option that cannot run here is a skipped row with its
one-line reason, and the table carries the per-option verdict.  The GPU run is the lead's."""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import loss_curves  # noqa: E402
import throughput  # noqa: E402


def test_loss_curves_dry_run_compares_options_against_the_default():
    tokens = loss_curves.text_tokens(300, 5000)
    assert len(np.unique(tokens)) > 100 and np.array_equal(tokens, loss_curves.text_tokens(300, 5000))
    args = argparse.Namespace(steps=4, data="text", device="cpu", lr=3e-4, warmup_iters=2,
                              options=["default", "default (again)", "fp8-format hybrid", "hf bf16"])
    results = loss_curves.measure(throughput.spec_of("llama-1b", tiny=True), args)
    loss_curves.compare(results, 0.01)
    assert len(results["default"]["losses"]) == 4
    assert results["default (again)"]["max_rel_diff"] == 0.0 and results["default (again)"]["passed"]
    # device cpu: float8 refuses in one line, even on a machine with a GPU
    assert results["fp8-format hybrid"] == {"skipped": "--fp8-format: float8 training needs the model on a CUDA "
                                                       "GPU, got device cpu"}
    # transformers' own loop from the same weights on the same targets: the same first loss (before any
    # update; bf16 weights vs bf16 autocast over fp32 weights), compared with itself
    hf = results["hf bf16"]
    assert len(hf["losses"]) == 4 and abs(hf["losses"][0] - results["default"]["losses"][0]) < 1e-2 * hf["losses"][0]
    assert hf["max_rel_diff"] == 0.0
    table = loss_curves.markdown(results, 0.01)
    assert "| within 1% | pass | pass | pass |" in table and "fp8-format hybrid: skipped: --fp8-format" in table, table

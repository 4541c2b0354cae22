"""accelerate's own `examples/by_feature/megatron_lm_gpt_pretraining.py` (tests/assets/accelerate,
unmodified but for the Accelerator import and a telemetry call transformers 5 dropped) under the
real `accelerate launch`, on CPU/gloo, on a tiny local GPT-2 and local text files.

Each run goes to the end with --with_tracking and --checkpointing_steps; its output folder
(written by `accelerator.save_state`) loads with `AutoModelForCausalLM.from_pretrained` and gives
the eval loss the run printed; a second run with --resume_from_checkpoint continues from the
saved step and ends with the same weights and eval loss as the uninterrupted run.
"""
from __future__ import annotations

import hashlib
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from accelerate_config import write_megatron_config

ROOT = Path(__file__).resolve().parents[1]
ASSET = Path(__file__).parent / "assets" / "accelerate" / "megatron_lm_gpt_pretraining.py"
ASSET_SHA256 = "baf61bfc18c75d952f45fcca707fc2c7678f1335f8a46ba289d5f1f6314db914"
BLOCK, MICRO, NUM_MICRO = 16, 2, 2
EDITS = [  # (original line, replacement): the only changes to accelerate's script
    ("from accelerate import Accelerator, DistributedType, init_empty_weights\n",
     "from accelerate import DistributedType, init_empty_weights\nfrom hf_megatron import Accelerator\n"),
    ("from transformers.utils import check_min_version, send_example_telemetry\n",
     "from transformers.utils import check_min_version\n\n\ndef send_example_telemetry(*args, **kwargs):  "
     "# gone from transformers 5\n    pass\n"),
]
LAYOUTS = {"tp2": (2, 1, 2), "pp2": (1, 2, 2), "dp2": (1, 1, 2), "tp2pp2": (2, 2, 4)}


WORDS = ("the quick brown fox jumps over a lazy dog while megatron meets hugging face and tensor "
         "pipeline data parallel ranks train tiny models on small text files").split()


def edited_script(folder: Path) -> Path:
    text = ASSET.read_text()
    assert hashlib.sha256(ASSET.read_bytes()).hexdigest() == ASSET_SHA256, "the stored asset was modified"
    for old, new in EDITS:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    script = folder / "megatron_lm_gpt_pretraining.py"
    script.write_text(text)
    return script


def _text_of_blocks(tokenizer, blocks: int, rng: random.Random) -> str:
    """Short lines until the script's grouping (all tokens, cut in BLOCK) gives exactly `blocks`."""
    lines, tokens = [], 0
    while tokens // BLOCK < blocks:
        line = " ".join(rng.choice(WORDS) for _ in range(3)) + "\n"
        lines.append(line)
        tokens += len(tokenizer(line)["input_ids"])
    return "".join(lines)


def make_workspace(folder: Path, train_blocks: int = 16, eval_blocks: int = 8) -> dict:
    """A tiny GPT-2 whose vocabulary is its tokenizer's, and train / validation text files."""
    from test_convert_helpers import make_tokenizer
    from tiny import tiny_hf_model
    model_dir = folder / "model"
    tokenizer = make_tokenizer(model_dir)
    tiny_hf_model("gpt2", vocab_size=len(tokenizer), n_positions=64).save_pretrained(model_dir)
    rng = random.Random(0)
    files = {}
    for split, blocks in (("train", train_blocks), ("validation", eval_blocks)):
        files[split] = folder / f"{split}.txt"
        files[split].write_text(_text_of_blocks(tokenizer, blocks, rng))
    return {"model": model_dir, **files}


def launch(folder: Path, ws: dict, layout: str, out: str, *extra: str, sp: bool = True, timeout: int = 600):
    tp, pp, world = LAYOUTS[layout]
    config = folder / f"{layout}.yaml"
    write_megatron_config(config, world, tp, pp, NUM_MICRO, sp and tp > 1)
    accelerate = Path(sys.executable).with_name("accelerate")
    cmd = [str(accelerate), "launch", "--config_file", str(config), str(edited_script(folder)),
           "--model_name_or_path", str(ws["model"]), "--train_file", str(ws["train"]),
           "--validation_file", str(ws["validation"]), "--block_size", str(BLOCK),
           "--per_device_train_batch_size", str(MICRO), "--per_device_eval_batch_size", str(MICRO),
           "--learning_rate", "1e-3", "--weight_decay", "0.1", "--num_train_epochs", "2", "--seed", "7",
           "--output_dir", str(folder / out), "--with_tracking", "--report_to", "tensorboard", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               HF_DATASETS_CACHE=str(folder / "datasets_cache"),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=folder)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]
    return log


def printed_eval_losses(log: str) -> list[float]:
    return [float(x) for x in re.findall(r"epoch \d+: perplexity: \S+ eval_loss: (\S+)", log)]


def hf_eval_loss(model_dir: Path, ws: dict, global_eval_batch: int) -> float:
    """The script's eval loss recomputed with plain transformers: mean over eval batches of the
    batch's mean token loss (all blocks have BLOCK tokens)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    lines = ws["validation"].read_text().splitlines(keepends=True)
    ids = [t for line in lines for t in tokenizer(line)["input_ids"]]
    blocks = torch.tensor(ids[: len(ids) // BLOCK * BLOCK]).view(-1, BLOCK)
    assert len(blocks) % global_eval_batch == 0, "choose sizes without a ragged last eval batch"
    with torch.no_grad():
        losses = [model(input_ids=b, labels=b).loss for b in blocks.split(global_eval_batch)]
    return torch.stack(losses).mean().item()


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    folder = tmp_path_factory.mktemp("accelerate_script")
    return folder, make_workspace(folder)


def _check_run(folder: Path, ws: dict, layout: str, log: str, out: str, epochs: int = 2) -> list[float]:
    tp, pp, world = LAYOUTS[layout]
    dp = world // (tp * pp)
    evals = printed_eval_losses(log)
    assert len(evals) == epochs, log[-3000:]  # one eval per epoch the run trains
    assert all(math.isfinite(x) for x in evals)
    output = folder / out
    assert (output / "latest_checkpointed_iteration.txt").is_file() and (output / "config.json").is_file()
    assert (output / "clm_no_trainer").is_dir(), "tensorboard logs (--with_tracking) missing"
    reference = hf_eval_loss(output, ws, dp * MICRO * NUM_MICRO)
    assert abs(reference - evals[-1]) <= 1e-5 * abs(reference), (reference, evals)
    return evals


def test_script_tp2_runs_with_tracking_and_checkpoints(workspace):
    """The default run's representative: tp2 (sequence parallel), checkpoint every 3 steps.
    (Resuming is launched in the slow matrix below; test_accelerate_state checks it in-process.)"""
    folder, ws = workspace
    log = launch(folder, ws, "tp2", "run_default", "--checkpointing_steps", "3")
    _check_run(folder, ws, "tp2", log, "run_default")
    assert (folder / "run_default" / "step_3" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    # the script took its Megatron-LM branches: the final save_state wrote Megatron-LM's layout
    assert (folder / "run_default" / "latest_checkpointed_iteration.txt").read_text().strip() == "8"


@pytest.mark.slow
@pytest.mark.parametrize("layout,resume_step", [("tp2", 3), ("pp2", 2), ("dp2", 2), ("tp2pp2", 2)])
def test_script_layouts_run_resume_and_export(workspace, layout, resume_step):
    """Each layout to the end, then resumed from a mid-run checkpoint: the resumed run ends with
    the uninterrupted run's weights and eval loss.  (dp2 has 2 steps per epoch: its step_2 ends
    epoch 0, so the resumed run trains and evaluates epoch 1 only.)"""
    folder, ws = workspace
    log = launch(folder, ws, layout, f"run_{layout}", "--checkpointing_steps", str(resume_step))
    evals = _check_run(folder, ws, layout, log, f"run_{layout}")
    resumed = launch(folder, ws, layout, f"resumed_{layout}", "--resume_from_checkpoint",
                     str(folder / f"run_{layout}" / f"step_{resume_step}"))
    assert f"Resumed from checkpoint: {folder / f'run_{layout}' / f'step_{resume_step}'}" in resumed
    evals_resumed = _check_run(folder, ws, layout, resumed, f"resumed_{layout}", epochs=1 if layout == "dp2" else 2)
    assert abs(evals_resumed[-1] - evals[-1]) <= 1e-6 * abs(evals[-1]), (evals, evals_resumed)
    from test_convert_helpers import hf_tensors
    first, second = hf_tensors(folder / f"run_{layout}"), hf_tensors(folder / f"resumed_{layout}")
    assert first.keys() == second.keys()
    for name in first:
        assert torch.allclose(first[name], second[name], rtol=0, atol=1e-6), name

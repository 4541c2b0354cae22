"""`accelerate launch --config_file <megatron yaml> examples/accelerate/clm_example.py` on CPU, NVIDIA's
megatron package absent: a plain accelerate loop (nlp_example.py style) with gradient accumulation,
weight-decay parameter groups, a transformers LR schedule, prepare in several calls, eval with
logits + gather_for_metrics, unwrap_model(...).save_pretrained twice into one folder, generate,
save_model, get_state_dict and save_state.

Reference: plain transformers + torch AdamW in one process on the same global batches: the
per-batch losses agree to 1e-5 and the exported weights are the trained model's."""
import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, get_linear_schedule_with_warmup

from accelerate_config import write_megatron_config
from test_accelerate_script import BLOCK, _text_of_blocks
from tiny import rel_err, tiny_hf_model

ROOT = Path(__file__).resolve().parents[1]
MICRO, NUM_MICRO, LR, WD, WARMUP, EPOCHS = 2, 2, 1e-3, 0.1, 1, 2



def _workspace(folder: Path, train_blocks: int, eval_blocks: int) -> dict:
    from test_convert_helpers import make_tokenizer
    model_dir = folder / "model"
    tokenizer = make_tokenizer(model_dir)
    tiny_hf_model("llama", vocab_size=len(tokenizer)).save_pretrained(model_dir)
    rng = random.Random(1)
    files = {"model": model_dir}
    for split, blocks in (("train", train_blocks), ("validation", eval_blocks)):
        files[split] = folder / f"{split}.txt"
        files[split].write_text(_text_of_blocks(tokenizer, blocks, rng))
    return files


def _blocks(tokenizer, path: Path) -> torch.Tensor:
    ids = tokenizer(path.read_text())["input_ids"]
    return torch.tensor(ids[: len(ids) // BLOCK * BLOCK]).view(-1, BLOCK)


def _reference(ws: dict, global_batch: int, accumulation: int):
    """Plain transformers: the same groups, schedule, clipping and accumulation on global batches.
    The schedule as plain accelerate runs the script with one process per micro batch of a global
    batch: sized from a loader of micro batches and stepped once per process after every update."""
    tokenizer = AutoTokenizer.from_pretrained(ws["model"])
    model = AutoModelForCausalLM.from_pretrained(ws["model"], dtype=torch.float32)
    train = _blocks(tokenizer, ws["train"]).split(global_batch)
    no_decay = ("bias", "norm")
    groups = [{"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
               "weight_decay": WD},
              {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)],
               "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=LR)
    micro_batches = -(-len(_blocks(tokenizer, ws["train"])) // MICRO)  # len() of the script's unprepared loader
    scheduler = get_linear_schedule_with_warmup(optimizer, WARMUP, micro_batches * EPOCHS // accumulation)
    losses, accuracies = [], []
    for _ in range(EPOCHS):
        for i, batch in enumerate(train):
            loss = model(input_ids=batch, labels=batch).loss
            (loss / accumulation).backward()
            losses.append(loss.item())
            if (i + 1) % accumulation == 0 or i + 1 == len(train):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                for _ in range(global_batch // MICRO):  # dp x num_micro_batches
                    scheduler.step()
                optimizer.zero_grad()
        with torch.no_grad():
            evals = _blocks(tokenizer, ws["validation"])
            predictions = model(input_ids=evals).logits.argmax(-1)
            accuracies.append((predictions[:, :-1] == evals[:, 1:]).float().mean().item())
    return model, losses, accuracies, len(evals)


def _launch(folder: Path, ws: dict, tp: int, pp: int, world: int, accumulation: int) -> dict:
    config = folder / "megatron.yaml"
    write_megatron_config(config, world, tp, pp, NUM_MICRO, tp > 1)
    accelerate = Path(sys.executable).with_name("accelerate")
    out = folder / "out"
    cmd = [str(accelerate), "launch", "--config_file", str(config), str(ROOT / "examples/accelerate/clm_example.py"),
           "--model", str(ws["model"]), "--train_file", str(ws["train"]), "--validation_file", str(ws["validation"]),
           "--output_dir", str(out), "--block_size", str(BLOCK), "--batch_size", str(MICRO), "--eval_batch_size", "3",
           "--gradient_accumulation_steps", str(accumulation), "--lr", str(LR), "--weight_decay", str(WD),
           "--warmup", str(WARMUP), "--num_epochs", str(EPOCHS)]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    assert "distributed type DistributedType.MEGATRON_LM" in result.stdout
    return json.loads((out / "results.json").read_text())


def _check(folder: Path, ws: dict, tp: int, pp: int, world: int, train_blocks: int, accumulation: int):
    dp = world // (tp * pp)
    results = _launch(folder, ws, tp, pp, world, accumulation)
    reference, losses, accuracies, eval_count = _reference(ws, MICRO * NUM_MICRO * dp, accumulation)
    assert len(results["losses"]) == len(losses) == EPOCHS * train_blocks // (MICRO * NUM_MICRO * dp)
    for step, (ours, theirs) in enumerate(zip(results["losses"], losses)):
        assert abs(ours - theirs) <= 1e-5 * abs(theirs), (step, results["losses"], losses)
    # gather_for_metrics: every eval sample once (duplicates of an uneven last batch dropped)
    assert [e["samples"] for e in results["eval"]] == [eval_count] * EPOCHS
    for ours, theirs in zip([e["accuracy"] for e in results["eval"]], accuracies):
        assert abs(ours - theirs) <= 1e-6, (results["eval"], accuracies)
    out = folder / "out"
    exported = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32)
    theirs = dict(reference.named_parameters())
    for name, weight in exported.named_parameters():
        assert rel_err(weight, theirs[name]) <= 2e-4, name  # Adam amplifies 1e-7 noise on tiny grads
    assert results["state_dict_names"] == sorted(reference.state_dict())
    saved = AutoModelForCausalLM.from_pretrained(out / "save_model", dtype=torch.float32)
    for (name, a), (_, b) in zip(exported.named_parameters(), saved.named_parameters()):
        assert torch.equal(a, b), name
    prompt = torch.tensor([results["generated"][0][:4]])
    assert exported.generate(prompt, max_new_tokens=6, do_sample=False).tolist() == results["generated"]
    updates = EPOCHS * -(-train_blocks // (MICRO * NUM_MICRO * dp * accumulation))
    assert (out / "state" / "latest_checkpointed_iteration.txt").read_text().strip() == str(updates)
    assert not [p for p in (out / "hf").iterdir() if p.name.startswith(".")], "a partial save was left behind"


def test_plain_loop_tp2_with_accumulation_matches_transformers(tmp_path):
    assert importlib.util.find_spec("megatron.training") is None  # NVIDIA's Megatron-LM is not installed
    ws = _workspace(tmp_path, train_blocks=12, eval_blocks=5)  # 3 batches: accumulation 2 ends on a short group
    _check(tmp_path, ws, tp=2, pp=1, world=2, train_blocks=12, accumulation=2)


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,world", [(1, 2, 2), (1, 1, 2), (2, 2, 4)])
def test_plain_loop_layouts(tmp_path, tp, pp, world):
    ws = _workspace(tmp_path, train_blocks=16, eval_blocks=5)  # dp2: 5 eval samples, uneven last batch
    _check(tmp_path, ws, tp=tp, pp=pp, world=world, train_blocks=16, accumulation=1)

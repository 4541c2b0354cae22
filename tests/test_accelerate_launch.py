"""`accelerate launch --config_file <megatron yaml> examples/accelerate/train.py` on CPU, with NVIDIA's
megatron package absent: the per-step losses equal a plain single-process transformers + AdamW loop."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers import get_cosine_schedule_with_warmup

from tiny import rel_err, tiny_hf_model

ROOT = Path(__file__).resolve().parents[1]
STEPS, MICRO, NUM_MICRO, SEQ, LR = 3, 2, 2, 16, 1e-3
BATCH = MICRO * NUM_MICRO  # samples per step at dp 1 (accelerate: micro batch x num_micro_batches x dp)

YAML = """compute_environment: LOCAL_MACHINE
distributed_type: MEGATRON_LM
mixed_precision: 'no'
num_machines: 1
num_processes: 2
machine_rank: 0
rdzv_backend: static
same_network: true
use_cpu: false
main_process_port: {port}
megatron_lm_config:
  megatron_lm_tp_degree: 2
  megatron_lm_pp_degree: 1
  megatron_lm_num_micro_batches: 2
  megatron_lm_sequence_parallelism: true
  megatron_lm_gradient_clipping: 1.0
"""


def _reference_losses(model_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # the same draw as examples/accelerate/train.py makes
    ids = torch.randint(0, model.config.vocab_size, (SEQ * MICRO * STEPS * 64,), generator=torch.Generator().manual_seed(0))
    blocks = ids.view(-1, SEQ)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    scheduler = get_cosine_schedule_with_warmup(optimizer, 0, STEPS)
    losses = []
    for step in range(STEPS):
        batch = blocks[step * BATCH:(step + 1) * BATCH]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model


def test_accelerate_launch_megatron_config_matches_plain_training(tmp_path):
    assert importlib.util.find_spec("megatron.training") is None  # NVIDIA's Megatron-LM is not installed
    from dist import free_port
    tiny_hf_model("llama").save_pretrained(tmp_path / "model")
    config = tmp_path / "megatron.yaml"
    config.write_text(YAML.format(port=free_port()))
    log = tmp_path / "losses.json"
    accelerate = Path(sys.executable).with_name("accelerate")
    cmd = [str(accelerate), "launch", "--config_file", str(config), str(ROOT / "examples/accelerate/train.py"),
           "--model", str(tmp_path / "model"), "--steps", str(STEPS), "--batch-size", str(MICRO),
           "--seq-len", str(SEQ), "--lr", str(LR), "--log-file", str(log), "--save", str(tmp_path / "ckpt"),
           "--save-hf", str(tmp_path / "hf_out")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    ours = json.loads(log.read_text())["losses"]
    reference, trained = _reference_losses(tmp_path / "model")
    assert len(ours) == STEPS
    for step, (a, b) in enumerate(zip(ours, reference)):
        assert abs(a - b) <= 1e-5 * abs(b), (step, ours, reference)
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(STEPS)
    assert (tmp_path / "ckpt" / f"iter_{STEPS:07d}" / "mp_rank_01" / "model_optim_rng.pt").is_file()
    # the TP-trained model comes back as a transformers folder holding plain training's weights
    # (Adam makes near-zero-gradient entries noisy: same per-tensor tolerance as test_training_parity)
    from transformers import AutoModelForCausalLM
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out", dtype=torch.float32)
    theirs = dict(trained.named_parameters())
    for name, weight in exported.named_parameters():
        assert rel_err(weight, theirs[name]) <= 2e-4, name
    assert not list(tmp_path.glob(".hf_out*")), "the scratch checkpoint was not removed"

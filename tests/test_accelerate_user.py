"""A new user's accelerate script (tests/accelerate_user_script.py) under `accelerate launch` with a
Megatron-LM config (tp2, sequence parallel, 2 micro batches) against the same script under plain
accelerate (one process, the same global batches):

* dynamic padding: batch lengths 15 and 13 (not multiples of tp) train and evaluate, with the
  losses, `accelerator.clip_grad_norm_`'s norms (before clipping), eval loss and logits of plain
  accelerate;
* an optimizer built on the prepared model's parameters trains as the usual order does;
* an IterableDataset (streaming) loader: the tp ranks read the same batches (no dispatching);
* `model(**batch, use_cache=False)` and `return_dict=False` (a tuple) work as in transformers;
* `accelerator.device` is `cpu`, as plain accelerate's;
* user mistakes print one line per rank naming the accelerate config field (no traceback).

and tests/accelerate_checkpoint_script.py the same way: gradient accumulation, a transformers cosine
schedule, register_for_checkpointing, automatic checkpoint naming with total_limit and a mid-epoch
resume (load_state + skip_first_batches) give plain accelerate's losses, lrs, norms and folders;

and tests/accelerate_schedule_script.py at dp 2 against plain accelerate with 2 processes (torchrun):
a transformers / torch LR schedule sized from the unprepared loader steps as accelerate's
AcceleratedScheduler steps it (dp x num_micro_batches steps per update, on sync steps only under
accumulation, once per call with step_scheduler_with_optimizer=False, OneCycleLR's total_steps
respected), so the lr of every update and the losses are plain accelerate's.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from accelerate_config import write_megatron_config

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).with_name("accelerate_user_script.py")
MICRO, NUM_MICRO = 2, 2


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "MEGATRON_LM_"))}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return env


def _launch(folder: Path, world: int, tp: int, *args: str, pp: int = 1) -> subprocess.CompletedProcess:
    config = write_megatron_config(folder / f"tp{tp}_pp{pp}_world{world}.yaml", world, tp, pp, NUM_MICRO, tp > 1)
    accelerate = Path(sys.executable).with_name("accelerate")
    cmd = [str(accelerate), "launch", "--config_file", str(config), str(SCRIPT), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=folder)


def _plain(folder: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300,
                          env=_env(), cwd=folder)


def _close(ours: list[float], theirs: list[float], tol: float = 1e-5) -> bool:
    return len(ours) == len(theirs) and all(abs(a - b) <= tol * abs(b) for a, b in zip(ours, theirs))


def _compare_with_plain_accelerate(folder: Path, arch: str, tp: int, pp: int, world: int) -> None:
    """dp = 1: plain accelerate's batch is the global batch, micro x num_micro_batches."""
    megatron = _launch(folder, world, tp, str(folder / "megatron.pt"), "--batch_size", str(MICRO), "--arch", arch,
                       pp=pp)
    assert megatron.returncode == 0, (megatron.stdout + megatron.stderr)[-6000:]
    plain = _plain(folder, str(folder / "plain.pt"), "--batch_size", str(MICRO * NUM_MICRO), "--arch", arch)
    assert plain.returncode == 0, (plain.stdout + plain.stderr)[-6000:]
    ours, theirs = torch.load(folder / "megatron.pt"), torch.load(folder / "plain.pt")
    assert ours["distributed_type"] == "DistributedType.MEGATRON_LM" and theirs["distributed_type"] == "DistributedType.NO"
    assert ours["device"] == theirs["device"] == "cpu"
    for order in ("usual", "optimizer_after_model", "iterable"):
        a, b = ours[order], theirs[order]
        assert _close(a["losses"], b["losses"]), (order, a["losses"], b["losses"])
        assert _close(a["norms"], b["norms"]), (order, a["norms"], b["norms"])
        assert min(a["norms"]) > 1.0  # the norm before clipping (max_norm 1.0), as torch returns it
        assert _close([a["eval_loss"], a["eval_loss_only"]], [b["eval_loss"]] * 2), (order, a, b["eval_loss"])
        assert a["logits"].shape == b["logits"].shape == (4, 15, 300)  # sequence padding stripped
        real = b["mask"].bool()  # the collator's padding is unscored; transformers' logits there are its own
        error = (a["logits"][real] - b["logits"][real]).norm() / b["logits"][real].norm()
        assert error <= 5e-5, (order, error)  # after 3 Adam steps at lr 1e-2 (1e-7 noise grows); losses are 1e-5
    assert ours["usual"]["losses"] == ours["optimizer_after_model"]["losses"] == ours["iterable"]["losses"]


def test_dynamic_padding_norms_and_optimizer_order_match_plain_accelerate(tmp_path):
    _compare_with_plain_accelerate(tmp_path, "gpt2", tp=2, pp=1, world=2)


@pytest.mark.slow
@pytest.mark.parametrize("arch,tp,pp,world", [("llama", 2, 1, 2), ("gpt2", 2, 2, 4)])
def test_dynamic_padding_layouts(tmp_path, arch, tp, pp, world):
    """RoPE with GQA (position ids of the padding); the pipeline's activations of a padded length."""
    _compare_with_plain_accelerate(tmp_path, arch, tp, pp, world)


def _one_line_per_rank(result: subprocess.CompletedProcess, world: int, needles: list[str]) -> str:
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if ": error: " in line and "accelerate_user_script.py" in line]
    assert len(lines) == world, result.stderr[-4000:]
    assert len({line.split("]: ", 1)[-1] for line in lines}) == 1, lines
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert "hf_megatron/" not in result.stderr, result.stderr[-4000:]  # no traceback through our code
    return lines[0]


@pytest.mark.slow  # ~20 s of accelerate launch; the default run keeps the suite under 15 min
def test_user_mistakes_are_one_line_naming_the_accelerate_config(tmp_path):
    world = _launch(tmp_path, 2, 3, str(tmp_path / "x.pt"), "--batch_size", "2")
    _one_line_per_rank(world, 2, ["num_processes=2", "megatron_lm_tp_degree (3)"])
    heads = _launch(tmp_path, 2, 2, str(tmp_path / "x.pt"), "--batch_size", "2", "--case", "heads")
    line = _one_line_per_rank(heads, 2, ["megatron_lm_tp_degree=2", "num_attention_heads (n_head)=3"])
    assert "num_key_value_heads" not in line  # GPT-2's config has no such field
    dummy = _plain(tmp_path, str(tmp_path / "x.pt"), "--batch_size", "2", "--case", "dummy_loader")
    _one_line_per_rank(dummy, 1, ["MegatronLMDummyDataLoader", "build_gpt_datasets"])


CHECKPOINT_SCRIPT = Path(__file__).with_name("accelerate_checkpoint_script.py")


def test_checkpointing_as_accelerate_documents_it_matches_plain_accelerate(tmp_path):
    """accelerate_checkpoint_script.py: gradient accumulation + a cosine schedule, register_for_checkpointing,
    a save pre-hook, automatic checkpoint naming with total_limit, a mid-epoch resume with
    skip_first_batches -- under Megatron-LM (tp2, sp, 2 micro batches) as under plain accelerate."""
    (tmp_path / "megatron").mkdir()
    (tmp_path / "plain").mkdir()
    config = write_megatron_config(tmp_path / "tp2.yaml", 2, 2, 1, NUM_MICRO, True)
    accelerate = Path(sys.executable).with_name("accelerate")
    megatron = subprocess.run([str(accelerate), "launch", "--config_file", str(config), str(CHECKPOINT_SCRIPT),
                               "out.pt", "--batch_size", str(MICRO)], capture_output=True, text=True, timeout=300,
                              env=_env(), cwd=tmp_path / "megatron")
    assert megatron.returncode == 0, (megatron.stdout + megatron.stderr)[-6000:]
    plain = subprocess.run([sys.executable, str(CHECKPOINT_SCRIPT), "out.pt", "--batch_size", str(MICRO * NUM_MICRO)],
                           capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path / "plain")
    assert plain.returncode == 0, (plain.stdout + plain.stderr)[-6000:]
    ours, theirs = torch.load(tmp_path / "megatron" / "out.pt"), torch.load(tmp_path / "plain" / "out.pt")
    for run in ("full", "resumed"):
        assert _close(ours[run]["losses"], theirs[run]["losses"]), (run, ours[run], theirs[run])
        assert _close(ours[run]["norms"], theirs[run]["norms"]), (run, ours[run], theirs[run])
        assert _close(ours[run]["lrs"], theirs[run]["lrs"]), (run, ours[run], theirs[run])
    assert len(ours["full"]["norms"]) == 6  # 12 batches, 2 per update
    # the resumed run continues exactly where the uninterrupted one was after 8 batches
    assert ours["resumed"]["losses"] == ours["full"]["losses"][8:]
    assert ours["resumed"]["lrs"] == ours["full"]["lrs"][8:]
    for key, expected in (("kept", ["checkpoint_1", "checkpoint_2"]), ("hooked", ["checkpoint_0", "checkpoint_1",
                          "checkpoint_2"]), ("save_iteration", 3), ("counter_mid", 8), ("counter_newest", 12)):
        assert ours[key] == theirs[key] == expected, (key, ours[key], theirs[key])
    newest = tmp_path / "megatron" / "proj" / "checkpoints" / "checkpoint_2"
    assert (newest / "custom_checkpoint_0.pkl").is_file() and (newest / "latest_checkpointed_iteration.txt").is_file()


SCHEDULE_SCRIPT = Path(__file__).with_name("accelerate_schedule_script.py")
SCHEDULE_CASES = ("linear", "accumulate", "manual", "onecycle")


def _compare_schedules_with_plain_accelerate(folder: Path, tp: int, world: int, num_micro: int, samples: int) -> None:
    """Megatron at dp = world / tp with num_micro micro batches of 2 against plain accelerate with
    dp x num_micro processes reading batches of 2: the same script, the same global batches."""
    config = write_megatron_config(folder / "megatron.yaml", world, tp, 1, num_micro, tp > 1)
    accelerate = Path(sys.executable).with_name("accelerate")
    common = [str(SCHEDULE_SCRIPT), "out.pt", "--batch_size", "2", "--samples", str(samples)]
    (folder / "megatron").mkdir()
    (folder / "plain").mkdir()
    megatron = subprocess.run([str(accelerate), "launch", "--config_file", str(config), *common], capture_output=True,
                              text=True, timeout=300, env=_env(), cwd=folder / "megatron")
    assert megatron.returncode == 0, (megatron.stdout + megatron.stderr)[-6000:]
    processes = world // tp * num_micro
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
    plain = subprocess.run([*torchrun, *common], capture_output=True, text=True, timeout=300,
                           env=dict(_env(), ACCELERATE_USE_CPU="true"), cwd=folder / "plain")
    assert plain.returncode == 0, (plain.stdout + plain.stderr)[-6000:]
    ours, theirs = torch.load(folder / "megatron" / "out.pt"), torch.load(folder / "plain" / "out.pt")
    assert ours["distributed_type"] == "DistributedType.MEGATRON_LM", ours["distributed_type"]
    assert theirs["distributed_type"] == "DistributedType.MULTI_CPU" and theirs["num_processes"] == processes
    for case in SCHEDULE_CASES:
        a, b = ours[case], theirs[case]
        assert a["steps"] == b["steps"] and len(a["lrs"]) == len(b["lrs"]) > 4, (case, a, b)
        assert _close(a["lrs"], b["lrs"], 1e-12) and _close(a["used"], b["used"], 1e-12), (case, a["lrs"], b["lrs"])
        assert _close(a["losses"], b["losses"]), (case, a["losses"], b["losses"])
        assert a["beta1"] == b["beta1"], (case, a["beta1"], b["beta1"])  # OneCycleLR cycles it
    assert ours["onecycle"]["beta1"] != 0.9  # cycled away from AdamW's default
    # the schedules really moved: from 0 up through the warmup and down to 0 at the end of the run
    for case in ("linear", "accumulate", "manual"):
        lrs = ours[case]["lrs"]
        assert lrs[0] == lrs[-1] == 0.0 and max(lrs) >= 5e-3, (case, lrs)


@pytest.mark.slow  # ~20 s of accelerate launch; the default run keeps the suite under 15 min
def test_torch_schedule_steps_as_accelerate_at_dp2(tmp_path):
    """tp1 x dp2 against plain accelerate with 2 processes; 13 batches of 2: an odd count (OneCycleLR's
    total_steps would be overrun by the 14 steps of 7 updates)."""
    _compare_schedules_with_plain_accelerate(tmp_path, tp=1, world=2, num_micro=1, samples=26)


@pytest.mark.slow
@pytest.mark.parametrize("tp,world,num_micro,samples", [(2, 4, 1, 26), (1, 2, 2, 24)])
def test_torch_schedule_steps_as_accelerate_layouts(tmp_path, tp, world, num_micro, samples):
    """tp2 x dp2 (sequence parallel) against 2 processes; dp2 with 2 micro batches against 4 processes
    (one update reads dp x num_micro_batches batches of the script's loader: 4 steps per update)."""
    _compare_schedules_with_plain_accelerate(tmp_path, tp=tp, world=world, num_micro=num_micro, samples=samples)


@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")  # no optimizer is stepped here
def test_prepared_torch_scheduler_steps_as_accelerated_scheduler(monkeypatch):
    """In-process, against accelerate's AcceleratedScheduler itself (num_processes 2 there, dp 2 here):
    split_batches, step_scheduler_with_optimizer=False, a batch that only accumulates (adjust_scheduler
    or not), a skipped update, OneCycleLR stopped at total_steps."""
    from accelerate import scheduler as accelerate_scheduler

    from hf_megatron.integrations.accelerate import wrappers

    monkeypatch.setattr(accelerate_scheduler, "AcceleratorState", lambda: SimpleNamespace(num_processes=2))
    monkeypatch.setattr(wrappers.state, "get_state", lambda: SimpleNamespace(dp=2))

    def schedule(kind):
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
        if kind == "onecycle":
            return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1.0, total_steps=7, cycle_momentum=False)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))

    # (sync_gradients, skipped) per call
    calls = [(True, False), (False, False), (True, False), (True, True), (True, False), (True, False)]
    for kind in ("lambda", "onecycle"):
        for split_batches in (False, True):
            for with_optimizer in (True, False):
                for adjust in (True, False):
                    gradient_state = SimpleNamespace(sync_gradients=True, adjust_scheduler=adjust)
                    accelerator = SimpleNamespace(split_batches=split_batches, step_scheduler_with_optimizer=with_optimizer,
                                                  gradient_state=gradient_state,
                                                  state=SimpleNamespace(megatron_lm_plugin=SimpleNamespace(num_micro_batches=1)))
                    engine = SimpleNamespace(skipped_iter=False, user_scheduler=None, optimizer=None)
                    ours = wrappers.PreparedScheduler(schedule(kind), accelerator)
                    ours.bind(engine)
                    optimizer = SimpleNamespace(step_was_skipped=False)
                    theirs = accelerate_scheduler.AcceleratedScheduler(schedule(kind), optimizer, with_optimizer,
                                                                      split_batches)
                    theirs.gradient_state = gradient_state
                    for sync, skipped in calls:
                        gradient_state.sync_gradients, engine.skipped_iter, optimizer.step_was_skipped = sync, skipped, skipped
                        ours.step(), theirs.step()
                        label = (kind, split_batches, with_optimizer, adjust, sync, skipped)
                        assert ours.get_last_lr() == theirs.get_last_lr(), label
                        assert ours.original._step_count == theirs.scheduler._step_count, label
                        assert ours.original.last_epoch == theirs.scheduler.last_epoch, label

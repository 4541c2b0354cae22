"""`hf-megatron reshard --with-optimizer`: a run saved at layout A, resharded to layout B and
resumed there for 10 steps has the per-step losses of the unresharded run (A, uninterrupted),
fp32 within 1e-6 -- through the CLI as a user runs it (`hf-megatron train` under torchrun for
more than one process; losses read back from TensorBoard).  The reference run saves at step
N (--save-interval) and goes on to N + 10; the reshard reads that iteration N.

The optimizer must matter for the comparison to mean something: a weights-only reshard resumed
with --no-load-optim is checked to leave those losses.  Dropout is off (the tiny configs'),
so no loss depends on the RNG policy, which is checked on its own against the seeds a fresh run
uses (parallel/random.py)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from hf_megatron import cli
from hf_megatron.checkpoint.rng import CPU_TRACKER, MODEL_PARALLEL
from hf_megatron.checkpoint.unpickle import safe_load
from hf_megatron.parallel.random import TP_SEED_OFFSET
from tiny import tiny_config
from train_cli import base_args, cli_inprocess, env, last_line, make_workspace

SAVE_AT, MORE, SEED = 3, 10, 5
SCHEDULE = ["--lr", 1e-2, "--lr-decay-iters", 20, "--lr-decay-style", "cosine", "--lr-warmup-iters", 2,
            "--seed", SEED]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = make_workspace(tmp_path_factory.mktemp("reshard_optim"))
    tiny_config("gpt2").save_pretrained(root / "config_gpt2")  # tied embeddings: the last stage's copy
    tiny_config("llama", num_hidden_layers=4).save_pretrained(root / "config_llama4")  # for 2 x 2 virtual chunks
    return root


def layout_flags(tp: int = 1, pp: int = 1, dp: int = 1, distributed: bool = False, vpp: int | None = None
                 ) -> tuple[list, int]:
    flags = ["--tensor-model-parallel-size", tp, "--pipeline-model-parallel-size", pp]
    flags += ["--virtual-pipeline-model-parallel-size", vpp] if vpp else []
    return flags + (["--use-distributed-optimizer"] if distributed else []), tp * pp * dp


def train(root, iters, *extra, layout=None, arch="llama", precision=()):
    """`hf-megatron train` at `layout` (layout_flags' keywords): in this process for one rank,
    else under torchrun; returns stdout."""
    flags, world = layout_flags(**(layout or {}))
    args = base_args(root, iters, *SCHEDULE, *flags, *precision, *extra, config=False)
    args = ["--hf-config", root / ("config" if arch == "llama" else f"config_{arch}"), *args]
    return run_train(world, *args)


def run_train(world: int, *args) -> str:
    """`hf-megatron train *args` on `world` processes (in this process for one, else under torchrun);
    asserts it succeeds, returns stdout."""
    if world == 1:
        code, out, err = cli_inprocess(*args)
    else:
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 f"--nproc-per-node={world}", "-m", "hf_megatron.cli", "train", *map(str, args)],
                                capture_output=True, text=True, timeout=600, env=env())
        code, out, err = result.returncode, result.stdout, result.stderr
    assert code == 0, err[-3000:]
    return out


def losses(tb_dir) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {e.step: e.value for e in events.Scalars("lm loss")}


def reshard(src, out, tp: int, pp: int, *extra) -> None:
    code = cli.main(["reshard", "--src", str(src), "--out", str(out), "--tp", str(tp), "--pp", str(pp), *map(str, extra)])
    assert code == 0


def reference(root, name, layout, arch="llama", precision=()):
    """The unresharded run at `layout`: N + 10 steps, saved at N; (its save folder, losses)."""
    save = root / name
    if not (save / "tb").is_dir():
        train(root, SAVE_AT + MORE, "--save", save, "--save-interval", SAVE_AT, "--tensorboard-dir", save / "tb",
              layout=layout, arch=arch, precision=precision)
    return save, losses(save / "tb")


def resharded_resume(root, name, source, target, arch="llama", with_optimizer=True, precision=()):
    """Reshard `source`'s iteration N to `target`'s tp/pp and train it to N + 10 at `target`."""
    out = root / name
    reshard(source / f"iter_{SAVE_AT:07d}", out, target.get("tp", 1), target.get("pp", 1),
            *(["--with-optimizer"] if with_optimizer else []), *(["--vpp", target["vpp"]] if "vpp" in target else []))
    train(root, SAVE_AT + MORE, "--load", out, "--save", out, "--tensorboard-dir", out / "tb",
          *([] if with_optimizer else ["--no-load-optim", "--no-load-rng"]), layout=target, arch=arch,
          precision=precision)
    return losses(out / "tb")


def assert_same_losses(resumed: dict, unresharded: dict) -> None:
    steps = list(range(SAVE_AT + 1, SAVE_AT + MORE + 1))
    assert sorted(resumed) == steps
    print(f"max relative loss difference over {MORE} steps: "
          f"{max(abs(resumed[s] - unresharded[s]) / abs(unresharded[s]) for s in steps):.2e}")
    for step in steps:
        assert resumed[step] == pytest.approx(unresharded[step], rel=1e-6, abs=0), step
    assert len({round(unresharded[s], 4) for s in steps}) > MORE // 2  # the losses move


def test_tp1_to_tp2_resumes_with_the_unresharded_losses(workspace):
    source, unresharded = reference(workspace, "ref_1_1", {})
    assert_same_losses(resharded_resume(workspace, "fast_2_1", source, {"tp": 2}), unresharded)
    # without the optimizer state the same weights take other steps: the comparison is not vacuous
    restarted = resharded_resume(workspace, "weights_only", source, {}, with_optimizer=False)
    gap = max(abs(restarted[s] - unresharded[s]) / unresharded[s] for s in restarted)
    print(f"weights-only reshard, optimizer restarted: max relative loss difference {gap:.2e}")
    assert gap > 1e-3


CASES = [  # (source layout, target layout, architecture)
    ({}, {"tp": 2, "pp": 2}, "llama"),
    ({"tp": 2, "pp": 2}, {}, "llama"),
    ({"tp": 2}, {"pp": 2}, "llama"),
    ({"pp": 2}, {"tp": 2}, "llama"),
    ({"dp": 2, "distributed": True}, {}, "llama"),
    ({}, {"dp": 2, "distributed": True}, "llama"),
    ({"tp": 2}, {"pp": 2, "dp": 2, "distributed": True}, "gpt2"),  # tied embeddings; dp2 distributed at the end
    ({"pp": 2}, {"tp": 2}, "gpt2"),  # tied: the source's last-stage copy is left, the embedding read
    ({"pp": 2, "dp": 2, "distributed": True}, {"tp": 2}, "gpt2"),  # distrib_optim.pt with tied buckets alone
    ({}, {"pp": 2, "vpp": 2}, "llama4"),  # virtual pipeline chunks, both ways
    ({"pp": 2, "vpp": 2}, {"tp": 2}, "llama4"),
    ({"pp": 2, "vpp": 2, "distributed": True}, {}, "llama4"),  # distrib_optim.pt: a grad buffer per chunk
]


@pytest.mark.slow
@pytest.mark.parametrize("source_layout,target_layout,arch", CASES,
                         ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}{int(x)}" for k, x in v.items()) or "single")
def test_resume_after_reshard_equals_the_unresharded_run(workspace, source_layout, target_layout, arch):
    tag = "_".join(f"{k}{int(v)}" for k, v in source_layout.items()) or "single"
    source, unresharded = reference(workspace, f"ref_{arch}_{tag}", source_layout, arch)
    target_tag = "_".join(f"{k}{int(v)}" for k, v in target_layout.items()) or "single"
    resumed = resharded_resume(workspace, f"to_{arch}_{tag}_{target_tag}", source, target_layout, arch)
    assert_same_losses(resumed, unresharded)


@pytest.mark.slow
def test_bf16_main_weights_travel_apart_from_the_bf16_weights(workspace):
    """bf16 params with fp32 main weights (fp32_from_fp16_params in a full optimizer state):
    a pipeline split changes no arithmetic, so the losses stay those of the unresharded run."""
    source, unresharded = reference(workspace, "ref_bf16", {}, precision=["--bf16"])
    assert_same_losses(resharded_resume(workspace, "bf16_pp2", source, {"pp": 2}, precision=["--bf16"]), unresharded)


def test_rng_policy_keeps_existing_ranks_and_seeds_new_ones_as_a_fresh_run(workspace):
    source, _ = reference(workspace, "ref_1_1", {})
    out = workspace / "rng_2_2"
    reshard(source / f"iter_{SAVE_AT:07d}", out, 2, 2, "--with-optimizer")
    kept = safe_load(source / f"iter_{SAVE_AT:07d}" / "mp_rank_00" / "model_optim_rng.pt")["rng_state"][0]
    entry = {(t, p): safe_load(out / f"iter_{SAVE_AT:07d}" / f"mp_rank_{t:02d}_{p:03d}" / "model_optim_rng.pt"
                               )["rng_state"][0] for t in range(2) for p in range(2)}
    assert torch.equal(entry[(0, 0)]["torch_rng_state"], kept["torch_rng_state"])  # rank (0, 0) in both layouts
    assert torch.equal(entry[(0, 0)][CPU_TRACKER][MODEL_PARALLEL], kept[CPU_TRACKER][MODEL_PARALLEL])
    for p in range(2):  # the default streams agree over a stage's tp ranks
        assert torch.equal(entry[(0, p)]["torch_rng_state"], entry[(1, p)]["torch_rng_state"])
    new_stage = torch.Generator().manual_seed(SEED + 100).get_state()
    assert torch.equal(entry[(0, 1)]["torch_rng_state"], new_stage)
    for t, p in ((1, 0), (0, 1), (1, 1)):  # tensor-parallel stream of a new rank: seed + 100 p + 2718 + t
        fresh = torch.Generator().manual_seed(SEED + 100 * p + TP_SEED_OFFSET + t).get_state()
        assert torch.equal(entry[(t, p)][CPU_TRACKER][MODEL_PARALLEL], fresh)


def _reshard_error(*args) -> str:
    code, out, err = _cli_capture(["reshard", *map(str, args), "--with-optimizer"])
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return last_line(err)


def _cli_capture(argv):
    import contextlib
    import io
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exc:
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def test_bad_sources_are_one_line_errors(workspace, tmp_path):
    source, _ = reference(workspace, "ref_1_1", {})
    weights_only = tmp_path / "weights_only"
    reshard(source / f"iter_{SAVE_AT:07d}", weights_only, 1, 1)
    line = _reshard_error("--src", weights_only, "--out", tmp_path / "x", "--tp", 2)
    assert "model_optim_rng.pt" in line and "no optimizer entry" in line
    for flag in (["--ckpt-format", "torch_dist"], ["--legacy-names"]):
        line = _reshard_error("--src", source, "--out", tmp_path / "y", *flag)
        assert "leave --ckpt-format torch_dist and --legacy-names out" in line
    # weights stored in another dtype than the args' precision flags
    bent = tmp_path / "bent"
    reshard(source / f"iter_{SAVE_AT:07d}", bent, 1, 1, "--with-optimizer")
    rank_file = bent / f"iter_{SAVE_AT:07d}" / "mp_rank_00" / "model_optim_rng.pt"
    payload = safe_load(rank_file)
    payload["args"].bf16 = True
    torch.save(payload, rank_file)
    line = _reshard_error("--src", bent, "--out", tmp_path / "z", "--tp", 2, "--no-checkpoint-checksums")
    assert "stored as float32 but args say bfloat16" in line
    assert not (tmp_path / "x").exists() and not (tmp_path / "z").exists()


def test_a_nested_optimizer_entry_reshards_as_the_flat_one(workspace, tmp_path):
    """An fp32 run saves FP32Optimizer's entry (torch's {state, param_groups} at its top level);
    the same state nested under "optimizer" with main weights per param group (the
    Float16OptimizerWithFloat16Params nesting) gives the same resharded state."""
    import shutil
    source, _ = reference(workspace, "ref_1_1", {})
    nested = tmp_path / "nested"
    shutil.copytree(source, nested)
    rank_file = nested / f"iter_{SAVE_AT:07d}" / "mp_rank_00" / "model_optim_rng.pt"
    payload = safe_load(rank_file)
    entry = payload["optimizer"]
    assert "state" in entry and "param_groups" in entry  # saved flat
    payload["optimizer"] = {"optimizer": {"state": entry["state"], "param_groups": entry["param_groups"]},
                            "fp32_from_fp16_params": [[] for _ in entry["param_groups"]]}
    torch.save(payload, rank_file)
    for src, out in ((nested, tmp_path / "nested_tp2"), (source, tmp_path / "flat_tp2")):
        assert cli.main(["reshard", "--src", str(src / f"iter_{SAVE_AT:07d}"), "--out", str(out), "--tp", "2",
                         "--with-optimizer", "--no-checkpoint-checksums"]) == 0
    for t in range(2):
        rank = f"iter_{SAVE_AT:07d}/mp_rank_{t:02d}"
        nested_entry, flat_entry = (safe_load(tmp_path / f"{kind}_tp2" / rank / "model_optim_rng.pt")["optimizer"]
                                    for kind in ("nested", "flat"))
        # a plain fp32 source gives a plain target: FP32Optimizer's entry, no distrib_optim.pt
        assert not (tmp_path / "flat_tp2" / rank / "distrib_optim.pt").exists()
        assert sorted(flat_entry) == ["param_groups", "state"] and sorted(nested_entry) == sorted(flat_entry)
        assert nested_entry["param_groups"] == flat_entry["param_groups"]
        assert all(g["step"] == SAVE_AT for g in flat_entry["param_groups"])
        assert sorted(flat_entry["state"]) == list(range(sum(len(g["params"]) for g in flat_entry["param_groups"])))
        for k, moments in flat_entry["state"].items():
            assert float(moments["step"]) == SAVE_AT
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(nested_entry["state"][k][key], moments[key]), (k, key)


def test_a_full_state_with_other_param_groups_is_refused(workspace, tmp_path):
    import shutil
    source, _ = reference(workspace, "ref_1_1", {})
    merged = tmp_path / "one_group"
    shutil.copytree(source, merged)
    rank_file = merged / f"iter_{SAVE_AT:07d}" / "mp_rank_00" / "model_optim_rng.pt"
    payload = safe_load(rank_file)
    inner = payload["optimizer"]  # FP32Optimizer's entry: torch's state dict at the top level
    groups = inner["param_groups"]
    inner["param_groups"] = [{**groups[0], "params": [i for g in groups for i in g["params"]]}]
    torch.save(payload, rank_file)
    line = _reshard_error("--src", merged / f"iter_{SAVE_AT:07d}", "--out", tmp_path / "x", "--tp", 2,
                          "--no-checkpoint-checksums")
    assert str(rank_file) in line and "param groups of [15] params, the model's default groups have [10, 5]" in line
    assert not (tmp_path / "x").exists()


def test_target_optimizer_flags_are_checked(tmp_path):
    """The target's optimizer flags need --with-optimizer, and bucket flags a distributed target."""
    for flags, message in (
            (["--use-distributed-optimizer"], "--use-distributed-optimizer: describes the target's optimizer; "
                                              "give --with-optimizer as well"),
            (["--ddp-bucket-size", 100], "--ddp-bucket-size: describes the target's optimizer"),
            (["--with-optimizer", "--no-use-distributed-optimizer", "--overlap-grad-reduce"],
             "--overlap-grad-reduce / --ddp-bucket-size: describe a distributed optimizer's buckets"),
            (["--with-optimizer", "--ddp-bucket-size", 0], "--ddp-bucket-size: expected at least 1 element, got 0")):
        code, _, err = _cli_capture(["reshard", "--src", str(tmp_path), "--out", str(tmp_path / "x"), *map(str, flags)])
        assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert message in err, err
    assert not (tmp_path / "x").exists()


def test_source_hyper_parameters_read_either_nesting_and_bad_entries_name_the_file(tmp_path):
    """FP32Optimizer's entry (torch's state dict at the top) and Float16OptimizerWithFloat16Params'
    (nested under "optimizer", with the scaler beside it) give the same groups, without their params
    and step; an entry with no param groups is one error naming its file."""
    from hf_megatron.errors import CheckpointError
    from hf_megatron.training.reshard_optimizer import source_hyper_parameters
    where = tmp_path / "mp_rank_00" / "model_optim_rng.pt"
    groups = [{"lr": 1e-3, "weight_decay": 0.1, "params": [0, 1], "step": 3},
              {"lr": 1e-3, "weight_decay": 0.0, "params": [2], "step": 3}]
    scaler = {"scale": torch.tensor([4.0]), "growth_tracker": 1, "hysteresis_tracker": 2}
    flat = {"state": {}, "param_groups": groups}
    expected = [{"lr": 1e-3, "weight_decay": 0.1}, {"lr": 1e-3, "weight_decay": 0.0}]
    assert source_hyper_parameters(flat, 2, where) == (expected, None)
    got, got_scaler = source_hyper_parameters({"optimizer": flat, "grad_scaler": scaler}, 2, where)
    assert got == expected and torch.equal(got_scaler["scale"], scaler["scale"])
    for bad in ({"optimizer": None}, {"optimizer": {"state": {}}}, {"state": {}}):
        with pytest.raises(CheckpointError) as info:
            source_hyper_parameters(bad, 2, where)
        assert str(info.value).startswith(f"{where}: optimizer state: expected 'param_groups'"), info.value
    with pytest.raises(CheckpointError, match="optimizer entry has 2 param groups, the resharded rank has 3"):
        source_hyper_parameters(flat, 3, where)

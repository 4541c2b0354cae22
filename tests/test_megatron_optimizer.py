"""Optimizer state across hf_megatron and megatron-core 0.16.1 / Megatron-LM (core_v0.16.1), both ways.

* Ours -> megatron-core: a megatron-core GPTModel built from our checkpoint's args, and megatron-core's
  own optimizer for it (`_get_param_groups` + `_get_megatron_optimizer_based_on_param_groups`, the
  function Megatron-LM's `get_megatron_optimizer` calls: FP32Optimizer for fp32, Float16Optimizer-
  WithFloat16Params for bf16), `load_state_dict` our saved entry; then every param's Adam moments,
  step and fp32 main weight, looked up through megatron-core's own param objects and names, equal
  ours for the same name, and the groups carry our hyper-parameters.
* Megatron-LM -> ours: megatron-core trains its GPTModel K steps with its optimizer and
  OptimizerParamScheduler; the checkpoint is assembled as Megatron-LM's `save_checkpoint` (torch
  format, `generate_state_dict`) lays it out; `hf-megatron train --load` resumes it, and its losses
  at iterations K+1 and K+2 (the second after one update with the loaded moments) equal megatron-core
  continuing its own run on the same samples (megatron-core's GPTDataset for our corpus).

megatron-core on CPU (`megatron_core_on_cpu`): its optimizer classes and clip_grads make their scalar
bookkeeping tensors (found_inf, the unit loss scale, norm and overflow buffers) with device='cuda' and
accept only params whose `Tensor.type()` names a CUDA type.  Inside that block only, `torch.tensor` /
`torch.zeros` given device='cuda' return CPU tensors and `Tensor.type()` (no argument) of a CPU
tensor returns the CUDA type name ("torch.cuda.FloatTensor" for "torch.FloatTensor").  Nothing of
megatron-core's state handling or math is replaced.  Megatron-LM's `save_checkpoint` itself needs
megatron.training (not in the wheel, GPU-only imports): the test writes the same entries it would.
"""
from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import pytest
import torch

from dist import run_distributed
from hf_megatron.checkpoint.unpickle import safe_load
from tiny import VOCAB

K, GBS, SEQ = 2, 4, 32
PADDED_VOCAB = 384  # a multiple of 128 (make_vocab_size_divisible_by): no padded rows
HP = dict(lr=2e-3, min_lr=2e-4, warmup=1, decay=5, style="cosine", weight_decay=0.05, beta1=0.9, beta2=0.95,
          eps=1e-8, clip_grad=1.0)


@contextlib.contextmanager
def megatron_core_on_cpu():
    """See the module docstring: device='cuda' scalars on CPU, CUDA type names for CPU tensors."""
    real_tensor, real_zeros, real_type = torch.tensor, torch.zeros, torch.Tensor.type

    def on_cpu(make):
        def wrapped(*args, device=None, **kwargs):
            return make(*args, device="cpu" if str(device).startswith("cuda") else device, **kwargs)
        return wrapped

    def cuda_type(self, *args, **kwargs):
        name = real_type(self, *args, **kwargs)
        return name.replace("torch.", "torch.cuda.", 1) if not args and not kwargs and not self.is_cuda else name

    torch.tensor, torch.zeros, torch.Tensor.type = on_cpu(real_tensor), on_cpu(real_zeros), cuda_type
    try:
        yield
    finally:
        torch.tensor, torch.zeros, torch.Tensor.type = real_tensor, real_zeros, real_type


def megatron_core_optimizer(model, args):
    """What Megatron-LM's get_megatron_optimizer builds for one model chunk (no DDP wrapper: grads in .grad)."""
    from megatron.core import parallel_state
    from megatron.core.optimizer import (OptimizerConfig, _get_megatron_optimizer_based_on_param_groups,
                                         _get_param_groups)
    config = OptimizerConfig(optimizer="adam", lr=HP["lr"], min_lr=HP["min_lr"], weight_decay=HP["weight_decay"],
                             adam_beta1=HP["beta1"], adam_beta2=HP["beta2"], adam_eps=HP["eps"],
                             clip_grad=HP["clip_grad"], bf16=args.bf16, fp16=args.fp16, params_dtype=args.params_dtype)
    groups = _get_param_groups([model], config, None)
    with megatron_core_on_cpu():
        return _get_megatron_optimizer_based_on_param_groups(
            config, [model], groups, model_parallel_group=parallel_state.get_model_parallel_group())


def megatron_core_scheduler(optimizer):
    """Megatron-LM's get_optimizer_param_scheduler for these runs' flags (--train-iters K + 2)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    return OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=HP["lr"], min_lr=HP["min_lr"],
                                   lr_warmup_steps=HP["warmup"] * GBS, lr_decay_steps=HP["decay"] * GBS,
                                   lr_decay_style=HP["style"], start_wd=HP["weight_decay"],
                                   end_wd=HP["weight_decay"], wd_incr_steps=(K + 2) * GBS, wd_incr_style="constant")


def megatron_core_state(model, optimizer) -> dict:
    """{megatron-core param name: (step, exp_avg, exp_avg_sq, fp32 main weight)} through its own objects."""
    inner = optimizer.optimizer
    out = {}
    for name, p in param_names(model).items():
        main = getattr(p, "main_param", p)  # Float16Optimizer: the fp32 copy the inner Adam steps
        entry = inner.state.get(main, {})
        out[name] = (float(entry["step"]) if "step" in entry else None, entry["exp_avg"].clone(),
                     entry["exp_avg_sq"].clone(), main.detach().float().clone())
    return out


def our_state(chunk, optimizer) -> dict:
    """The same, from our optimizer (model_params[i] is stepped through main_params[i])."""
    name_of = {id(p): n for n, p in chunk.named_parameters()}
    out = {}
    for p, main in zip(optimizer.model_params, optimizer.main_params):
        entry = optimizer.optimizer.state.get(main, {})
        out[name_of[id(p)]] = (float(entry["step"]) if "step" in entry else None, entry.get("exp_avg"),
                               entry.get("exp_avg_sq"), main.detach().float().clone())
    return out


def mcore_model(args, tp: int = 1):
    """megatron-core GPTModel from the args; for bf16 wrapped in Float16Module as Megatron-LM's
    get_model does (it casts every param, norms included, to bf16)."""
    from megatron.core.transformer.module import Float16Module
    from test_megatron_interop import mcore_model_from_args
    model = mcore_model_from_args(args, tp)
    return Float16Module(model.config, model) if args.bf16 or args.fp16 else model


def param_names(model) -> dict[str, torch.nn.Parameter]:
    """megatron-core's param names without Float16Module's `module.` prefix."""
    return {n.removeprefix("module."): p for n, p in model.named_parameters()}


def mcore_loss(model, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Megatron-LM's loss over a global batch: per-token cross entropy, mean over the tokens."""
    seq = tokens.shape[1]
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    losses = model(tokens, position_ids=torch.arange(seq)[None].expand_as(tokens), attention_mask=causal,
                   labels=labels)
    return losses.float().mean()


def _cpu_stand_ins():
    from megatron.core import tensor_parallel
    torch.cuda.current_device = lambda: "cpu"  # RoPE tables (no dropout here: nothing forks the CUDA RNG)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()


# ---------------------------------------------------------------- ours -> megatron-core

def _ours_into_megatron_core(rank, world, arch, dtype, folder):
    from megatron.core import parallel_state
    from hf_megatron.parallel import state
    from hf_megatron.training import build_model, build_optimizer, build_scheduler, setup_parallel, split_batch, \
        train_step
    from hf_megatron.training.checkpoint import save_checkpoint
    from tiny import engine_batch, tiny_hf_model
    from training_helpers import make_batches, training_config
    cfg = training_config({"tp": world}, lr=HP["lr"], min_lr=HP["min_lr"], weight_decay=HP["weight_decay"],
                          adam_beta2=HP["beta2"], bf16=dtype == "bf16")
    setup_parallel(cfg)
    chunks = build_model(tiny_hf_model(arch), cfg)
    optimizer, scheduler = build_optimizer(chunks, cfg), None
    scheduler = build_scheduler(optimizer, cfg)
    for batch in make_batches(2):
        train_step(chunks, optimizer, scheduler, split_batch(engine_batch(batch), cfg))
    save_checkpoint(folder, 2, chunks, optimizer, scheduler)
    ours = our_state(chunks[0], optimizer)
    ours_groups = [(g["lr"], g["weight_decay"], g["betas"], g["eps"]) for g in optimizer.param_groups]
    state.reset()

    parallel_state.initialize_model_parallel(world, 1)
    _cpu_stand_ins()
    payload = safe_load(Path(folder) / f"iter_0000002/mp_rank_0{rank}/model_optim_rng.pt")
    model = mcore_model(payload["args"], tp=world)
    loaded = getattr(model, "module", model).load_state_dict(payload["model"], strict=False)
    assert not loaded.unexpected_keys and all(k.endswith("_extra_state") for k in loaded.missing_keys)
    mcore_optimizer = megatron_core_optimizer(model, payload["args"])
    mcore_optimizer.load_state_dict(copy.deepcopy(payload["optimizer"]))
    theirs = megatron_core_state(model, mcore_optimizer)
    name_of = {id(getattr(p, "main_param", p)): n for n, p in param_names(model).items()}
    theirs_groups = [((g["lr"], g["weight_decay"], tuple(g["betas"]), g["eps"]), g["wd_mult"], g["max_lr"], g["min_lr"],
                      [name_of[id(p)] for p in g["params"]])
                     for g in mcore_optimizer.param_groups]
    kind = type(mcore_optimizer).__name__
    # megatron-core's own scheduler steps on the loaded groups (reads max_lr / min_lr / wd_mult there)
    megatron_core_scheduler(mcore_optimizer).step(GBS)
    parallel_state.destroy_model_parallel()
    return {"ours": ours, "theirs": theirs, "ours_groups": ours_groups, "theirs_groups": theirs_groups, "kind": kind,
            "entry_keys": sorted(payload["optimizer"]), "dtype": str(next(model.parameters()).dtype)}


@pytest.mark.parametrize("arch, dtype, kind, tp", [
    ("gpt2", "fp32", "FP32Optimizer", 1), ("qwen3", "bf16", "Float16OptimizerWithFloat16Params", 1),
    pytest.param("qwen3", "bf16", "Float16OptimizerWithFloat16Params", 2, marks=pytest.mark.slow)])
def test_megatron_core_optimizers_load_our_state(arch, dtype, kind, tp, tmp_path):
    for got in run_distributed(_ours_into_megatron_core, tp, (arch, dtype, str(tmp_path))):
        _check_megatron_core_holds_ours(got, dtype, kind)


def _check_megatron_core_holds_ours(got, dtype, kind):
    assert got["kind"] == kind
    assert got["entry_keys"] == (["param_groups", "state"] if dtype == "fp32" else ["fp32_from_fp16_params", "optimizer"])
    assert got["dtype"] == ("torch.float32" if dtype == "fp32" else "torch.bfloat16")
    ours, theirs = got["ours"], got["theirs"]
    assert sorted(ours) == sorted(theirs)
    for name, (step, exp_avg, exp_avg_sq, main) in theirs.items():
        assert step == ours[name][0] == 2.0, name
        assert torch.equal(exp_avg, ours[name][1]) and torch.equal(exp_avg_sq, ours[name][2]), name
        assert torch.equal(main, ours[name][3]), name
    # groups: ours in megatron-core's order (wd_mult 1 then 0), our hyper-parameters
    assert [g[1] for g in got["theirs_groups"]] == [1.0, 0.0]
    for (hyper, _, max_lr, min_lr, names), our_hyper in zip(got["theirs_groups"], got["ours_groups"]):
        assert (max_lr, min_lr) == (HP["lr"], HP["min_lr"])
        assert hyper == (our_hyper[0], our_hyper[1], tuple(our_hyper[2]), our_hyper[3])
    # megatron-core's rule put each param in its group: no decay for 1-D params and biases
    decay, no_decay = got["theirs_groups"][0][4], got["theirs_groups"][1][4]
    assert sorted(decay + no_decay) == sorted(theirs)
    assert all(theirs[n][3].ndim == 1 or n.endswith(".bias") for n in no_decay)
    assert not any(theirs[n][3].ndim == 1 or n.endswith(".bias") for n in decay)


# ---------------------------------------------------------------- Megatron-LM -> ours

def save_torch_format(folder: Path, args, model, optimizer, scheduler) -> None:
    """generate_state_dict (torch format): args, checkpoint_version, iteration, model, optimizer,
    opt_param_scheduler (rng_state left out, as with --no-save-rng: no CUDA RNG on CPU)."""
    args.ckpt_format = "torch"
    folder = folder / "mp_rank_00"
    folder.mkdir(parents=True)
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": K,
                "model": model.state_dict_for_save_checkpoint(), "optimizer": optimizer.state_dict(),
                "opt_param_scheduler": scheduler.state_dict(), "num_floating_point_operations_so_far": 0},
               folder / "model_optim_rng.pt")


def _megatron_lm_run(rank, world, root, dtype, save=save_torch_format):
    """megatron-core trains K steps from its own init, writes iteration K as Megatron-LM's
    save_checkpoint would (`save(iteration folder, args, model, optimizer, scheduler)`), then
    continues: (its losses at K+1 and K+2, its state at K by name)."""
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(1, 1)
    _cpu_stand_ins()
    root = Path(root)
    args = safe_load(root / "converted/release/mp_rank_00/model_optim_rng.pt")["args"]  # the model's args
    torch.manual_seed(3)
    model = mcore_model(args)
    optimizer = megatron_core_optimizer(model, args)
    scheduler = megatron_core_scheduler(optimizer)
    step = train_k_steps(model, optimizer, scheduler)
    write_megatron_lm_iteration(root, args, model, optimizer, scheduler, save)
    saved = megatron_core_state(model, optimizer)
    losses = next_two_losses(root, step, model)
    parallel_state.destroy_model_parallel()
    return losses, saved


def megatron_lm_train_step(model, optimizer, scheduler):
    """Megatron-LM's train_step on one global batch: step(tokens [GBS, SEQ + 1]) -> its loss."""
    def step(tokens: torch.Tensor) -> float:
        optimizer.zero_grad()
        loss = mcore_loss(model, tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        with megatron_core_on_cpu():
            updated, _, _ = optimizer.step()
        assert updated
        scheduler.step(increment=GBS)
        return loss.item()
    return step


def train_k_steps(model, optimizer, scheduler):
    """K of Megatron-LM's train_step on random tokens (any data: only the state after K steps
    matters); returns the step (megatron_lm_train_step)."""
    step = megatron_lm_train_step(model, optimizer, scheduler)
    gen = torch.Generator().manual_seed(5)
    for _ in range(K):
        step(torch.randint(1, VOCAB, (GBS, SEQ + 1), generator=gen))
    return step


def write_megatron_lm_iteration(root: Path, args, model, optimizer, scheduler, save=save_torch_format) -> Path:
    """<root>/megatron_lm/iter_K written by `save` (save_torch_format: Megatron-LM's torch format) and
    the tracker, with the args fields Megatron-LM's save_checkpoint sets; returns the rank folder."""
    args.iteration, args.consumed_train_samples, args.no_save_rng = K, K * GBS, True
    iteration = root / "megatron_lm" / f"iter_{K:07d}"
    save(iteration, args, model, optimizer, scheduler)
    (root / "megatron_lm" / "latest_checkpointed_iteration.txt").write_text(str(K))
    return iteration / "mp_rank_00"


def next_two_losses(root: Path, step, model) -> list[float]:
    """megatron-core continuing on the samples our loader gives after K * GBS (its GPTDataset for the
    corpus): the loss of training step K+1 (`step`), then the loss at K+2 after that update."""
    from data_oracle import mcore_datasets
    train, _, _ = mcore_datasets(([str(root / "corpus_text_document")], None), "90,10,0", SEQ, 1234,
                                 [(K + 2) * GBS, None, None])
    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:  # global batch i+1: samples i*GBS .. (i+1)*GBS
        samples = [train[j] for j in range(i * GBS, (i + 1) * GBS)]
        return tuple(torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in ("tokens", "labels"))

    tokens, labels = batch(K)
    losses = [step(torch.cat([tokens, labels[:, -1:]], dim=1))]
    tokens, labels = batch(K + 1)
    with torch.no_grad():
        losses.append(mcore_loss(model, tokens, labels).item())
    return losses


def _tensorboard_losses(folder: Path) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return {e.step: e.value for e in events.Scalars("lm loss")}


def resume_with_train(tmp_path: Path, dtype: str, *extra) -> dict[int, float]:
    """`hf-megatron train --load <tmp_path>/megatron_lm` to iteration K+2 with the run's hyper-parameters;
    its losses by iteration (it must resume at K+1)."""
    from train_cli import cli_inprocess
    from hf_megatron.training.checkpoint import checkpoint_info
    # megatron-core's CPU runs save no RNG (args.no_save_rng): Megatron-LM resumes those with --no-load-rng
    no_rng = checkpoint_info(tmp_path / "megatron_lm")["args"].get("no_save_rng")
    flags = [*resume_flags(tmp_path, dtype), *(["--no-load-rng"] if no_rng else []), *extra]
    code, out, err = cli_inprocess("--load", tmp_path / "megatron_lm", "--train-iters", K + 2,
                                   "--tensorboard-dir", tmp_path / "tb", *flags)
    assert code == 0, err[-3000:]
    assert f"iteration      {K + 1}/{K + 2}" in out and "iteration      1/" not in out
    return _tensorboard_losses(tmp_path / "tb")


@pytest.mark.parametrize("arch, dtype", [("gpt2", "fp32"), ("qwen2", "bf16")])
def test_train_resumes_a_megatron_lm_checkpoint_with_its_next_losses(arch, dtype, tmp_path):
    check_train_resumes_megatron_lm(tmp_path, arch, dtype, save_torch_format)


def resume_flags(tmp_path, dtype) -> list:
    """The flags of megatron-core's run in _megatron_lm_run (data, batch, schedule, AdamW, clipping)."""
    return ["--data-path", tmp_path / "corpus_text_document", "--split", "90,10,0", "--seq-length", SEQ,
            "--micro-batch-size", 2, "--global-batch-size", GBS, "--lr", HP["lr"], "--min-lr", HP["min_lr"],
            "--lr-warmup-iters", HP["warmup"], "--lr-decay-iters", HP["decay"], "--lr-decay-style", HP["style"],
            "--weight-decay", HP["weight_decay"], "--adam-beta1", HP["beta1"], "--adam-beta2", HP["beta2"],
            "--adam-eps", HP["eps"], "--clip-grad", HP["clip_grad"], "--log-interval", 1,
            *(["--bf16"] if dtype == "bf16" else [])]


def check_train_resumes_megatron_lm(tmp_path, arch, dtype, save, run=None) -> dict:
    """megatron-core's run saved by `save` (`run`, default _megatron_lm_run, called as run(rank, world,
    root, dtype, save)); `hf-megatron train --load` continues it with megatron-core's next two losses,
    and our reader holds its optimizer state exactly.
    Returns megatron-core's state at iteration K by name (megatron_core_state)."""
    from hf_megatron.conversion.convert import hf_to_megatron
    from test_convert_helpers import save_hf
    from train_cli import make_workspace
    make_workspace(tmp_path)
    # a vocabulary with no padding: Megatron-LM's loss runs over the padded vocabulary (its padded rows,
    # randomly initialised, take part in the softmax); ours masks the padding out, as transformers has none
    hf_to_megatron(save_hf(tmp_path / "hf", arch, vocab_size=PADDED_VOCAB), tmp_path / "converted", dtype=dtype)
    expected, saved = run_distributed(run or _megatron_lm_run, 1, (str(tmp_path), dtype, save))[0]
    ours = resume_with_train(tmp_path, dtype)
    # measured: fp32 1.6e-7 and 0; bf16 4e-5 and 8e-6 (two implementations' bf16 rounding)
    tolerance = 1e-6 if dtype == "fp32" else 1e-3
    assert ours[K + 1] == pytest.approx(expected[0], rel=tolerance)  # the loaded weights
    assert ours[K + 2] == pytest.approx(expected[1], rel=tolerance)  # one update with the loaded moments

    # what our reader put into our optimizer is megatron-core's state, name by name, exactly
    from hf_megatron.parallel import state
    from hf_megatron.training import build_model, build_optimizer, setup_parallel
    from hf_megatron.training.checkpoint import load_checkpoint
    from training_helpers import training_config
    from tiny import tiny_hf_model
    cfg = training_config({}, bf16=dtype == "bf16")
    setup_parallel(cfg)
    chunks = build_model(tiny_hf_model(arch, vocab_size=PADDED_VOCAB), cfg)
    optimizer = build_optimizer(chunks, cfg)
    assert load_checkpoint(tmp_path / "megatron_lm", chunks, optimizer, load_rng=False) == K
    loaded = our_state(chunks[0], optimizer)
    state.reset()
    assert sorted(loaded) == sorted(saved)
    for name, (step, exp_avg, exp_avg_sq, main) in saved.items():
        assert loaded[name][0] == step == float(K), name
        assert torch.equal(loaded[name][1], exp_avg) and torch.equal(loaded[name][2], exp_avg_sq), name
        assert torch.equal(loaded[name][3], main), name
    return saved


# ---------------------------------------------------------------- our readers (no megatron-core)

def _trained(dtype: str):
    from hf_megatron.training import build_model, build_optimizer, build_scheduler, setup_parallel, split_batch, \
        train_step
    from tiny import engine_batch, tiny_hf_model
    from training_helpers import make_batches, training_config
    cfg = training_config({}, bf16=dtype == "bf16")
    setup_parallel(cfg)
    chunks = build_model(tiny_hf_model("qwen3"), cfg)
    optimizer = build_optimizer(chunks, cfg)
    scheduler = build_scheduler(optimizer, cfg)
    for batch in make_batches(2):
        train_step(chunks, optimizer, scheduler, split_batch(engine_batch(batch), cfg))
    return cfg, chunks, optimizer


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_previous_layout_and_hyper_parameter_entries_of_either_layout_load(dtype):
    from hf_megatron.errors import CheckpointError
    from hf_megatron.parallel import state
    from hf_megatron.training import build_optimizer
    from hf_megatron.training.megatron_optimizer_layout import group_fields
    from hf_megatron.training.optimizer_state import parameter_state_from
    state.reset()
    cfg, chunks, optimizer = _trained(dtype)
    expected = our_state(chunks[0], optimizer)
    inner = optimizer.optimizer.state_dict()  # as the previous writer saved it: no megatron-core group fields
    inner["param_groups"] = [{k: v for k, v in g.items() if k not in group_fields(False)} for g in inner["param_groups"]]
    previous = {"optimizer": inner, "grad_scaler": {"scale": 1.0, "growth_tracker": 0, "hysteresis_tracker": 2},
                "fp32_from_fp16_params": [m for m, v in zip(optimizer.main_params, optimizer._model_views) if v is not None]}
    megatron = optimizer.state_dict()
    ps = parameter_state_from([megatron], optimizer.model_params, optimizer.megatron_order)
    # what a reshard writes beside a distrib_optim.pt: the entry without its per-param state
    stripped = copy.deepcopy(megatron)
    for key in ("state", "fp32_from_fp16_params"):
        stripped.pop(key, None)
        stripped.get("optimizer", {}).pop(key, None)
    for sd, parameter_state in ((previous, None), (megatron, None), (stripped, ps)):
        fresh = build_optimizer(chunks, cfg)
        fresh.load_state_dict(copy.deepcopy(sd), parameter_state=parameter_state)
        got = our_state(chunks[0], fresh)
        for name, (step, exp_avg, exp_avg_sq, main) in expected.items():
            assert got[name][0] == step == 2.0 and torch.equal(got[name][3], main), name
            assert torch.equal(got[name][1], exp_avg) and torch.equal(got[name][2], exp_avg_sq), name
        assert [g["lr"] for g in fresh.param_groups] == [g["lr"] for g in optimizer.param_groups]
    # a moment of the wrong shape: one line naming the param
    inner = megatron if dtype == "fp32" else megatron["optimizer"]
    inner["state"][0]["exp_avg"] = inner["state"][0]["exp_avg"][:-1]
    with pytest.raises(CheckpointError, match=r"exp_avg for embedding\.word_embeddings\.weight \(state 0\) has shape"):
        build_optimizer(chunks, cfg).load_state_dict(megatron)
    state.reset()

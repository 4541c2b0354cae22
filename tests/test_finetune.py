"""Fine-tuning as Megatron-LM does it, through `hf-megatron train`: --pretrained-checkpoint (a Megatron
checkpoint with optimizer state, a converted weights-only one in another TP layout, an HF folder)
and --finetune start at iteration 0 with a fresh optimizer and the given LR schedule; a preempted
fine-tune resumes from its own --save folder; --no-load-optim / --no-load-rng.

The first step runs at lr 0 (one warmup step), so the weights saved after it are the weights that
were loaded: they are compared with the source, bit for bit."""
import pytest

from train_cli import assert_same_weights, base_args, cli_inprocess, learning_rates, make_workspace, weights

from hf_megatron.checkpoint.unpickle import safe_load
from transformers import AutoModelForCausalLM

from hf_megatron.conversion.convert import hf_to_megatron, megatron_to_hf
from tiny import tiny_hf_model

SCHEDULE = ("--lr", 2e-3, "--lr-warmup-iters", 1, "--lr-decay-style", "constant", "--save-interval", 1)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = make_workspace(tmp_path_factory.mktemp("finetune"))
    tiny_hf_model("llama", seed=3).save_pretrained(root / "hf")
    hf_to_megatron(root / "hf", root / "converted", tp=2)  # weights only, `release`, another layout
    code, _, err = cli_inprocess(*base_args(root, 2, "--save", root / "base"))
    assert code == 0, err
    return root


def _finetune(root, save, iters, *extra):
    code, out, err = cli_inprocess(*base_args(root, iters, *SCHEDULE, "--save", save, *extra, config=False))
    assert code == 0, err[-2000:]
    return out


def _rank_file(folder, iteration):
    return safe_load(folder / f"iter_{iteration:07d}" / "mp_rank_00" / "model_optim_rng.pt")


def _fresh_training_state(folder):
    payload = _rank_file(folder, 1)
    assert payload["iteration"] == 1 and payload["consumed_train_samples"] == 4
    assert {s["step"].item() for s in payload["optimizer"]["state"].values()} == {1.0}
    assert payload["opt_param_scheduler"]["num_steps"] == 4  # samples: one step of the new run


@pytest.mark.parametrize("flags", [("--pretrained-checkpoint", "base"), ("--finetune", "--load", "base")])
def test_finetune_from_a_megatron_checkpoint_loads_weights_only(sources, flags):
    save = sources / f"ft_{flags[0][2:]}"
    out = _finetune(sources, save, 2, *[sources / f if f == "base" else f for f in flags])
    # the log shows the lr after each step (Megatron-LM's): the one warmup step is done at iteration 1
    assert "iteration      1/2" in out and learning_rates(out) == ["2.000e-03", "2.000e-03"]
    assert "fine-tuning from" in out
    assert_same_weights(weights(save, 1), weights(sources / "base", 2))
    _fresh_training_state(save)


def test_finetune_from_an_hf_folder_and_from_its_converted_checkpoint_agree(sources):
    out_hf = _finetune(sources, sources / "ft_hf", 2, "--pretrained-checkpoint", sources / "hf")
    out_conv = _finetune(sources, sources / "ft_conv", 2, "--pretrained-checkpoint", sources / "converted")
    assert "iteration      1/2" in out_hf and learning_rates(out_hf) == learning_rates(out_conv) == ["2.000e-03", "2.000e-03"]
    assert_same_weights(weights(sources / "ft_hf", 1), weights(sources / "ft_conv", 1))
    assert_same_weights(weights(sources / "ft_hf", 2), weights(sources / "ft_conv", 2))
    _fresh_training_state(sources / "ft_conv")
    # and they are the HF model's own tensors: back through the converter, compared with transformers' file
    megatron_to_hf(sources / "ft_hf" / "iter_0000001", sources / "ft_hf_back")
    original = AutoModelForCausalLM.from_pretrained(sources / "hf").state_dict()
    assert_same_weights(AutoModelForCausalLM.from_pretrained(sources / "ft_hf_back").state_dict(), original)
    # a release checkpoint given to --load is loaded weights-only too (Megatron-LM's rule)
    out = _finetune(sources, sources / "ft_release", 1, "--load", sources / "converted", "--hf-config",
                    sources / "hf")
    assert "iteration      1/1" in out
    assert_same_weights(weights(sources / "ft_release", 1), weights(sources / "ft_hf", 1))


def test_a_preempted_finetune_resumes_from_its_save_folder_not_the_pretrained_one(sources):
    save = sources / "ft_resume"
    # the decay horizon is part of the schedule's shape, which must match on resume (Megatron-LM's rule)
    _finetune(sources, save, 2, "--pretrained-checkpoint", sources / "base", "--load", save, "--lr-decay-iters", 4)
    out = _finetune(sources, save, 4, "--pretrained-checkpoint", sources / "base", "--load", save,
                    "--lr-decay-iters", 4)
    assert "iteration      3/4" in out and "iteration      1/4" not in out and "resuming from" in out
    assert _rank_file(save, 4)["consumed_train_samples"] == 16


def test_no_load_optim_starts_optimizer_and_schedule_afresh(sources):
    save = sources / "partial"
    _finetune(sources, save, 2, "--pretrained-checkpoint", sources / "base")
    out = _finetune(sources, save, 3, "--load", save, "--no-load-optim", "--lr-decay-iters", 2)
    # Megatron-LM: without the optimizer the LR schedule starts again too: one step of it (4 samples)
    assert "iteration      3/3" in out and learning_rates(out) == ["2.000e-03"]
    payload = _rank_file(save, 3)
    assert payload["opt_param_scheduler"]["num_steps"] == 4
    assert {s["step"].item() for s in payload["optimizer"]["state"].values()} == {1.0}
    assert payload["iteration"] == 3


@pytest.mark.parametrize("flags", [("--pretrained-checkpoint", "converted"), ("--finetune", "--load", "base"),
                                   ("--load", "partial_bf16", "--no-load-optim")])
def test_bf16_weights_loaded_without_optimizer_state_are_what_is_trained(sources, flags):
    """With --bf16 the optimizer's fp32 main weights were copied from the model before a weights-only load
    (--pretrained-checkpoint / --finetune of a Megatron checkpoint, --no-load-optim), so the first update
    wrote the build-time (uninitialised) values back: NaN at the second step.  Megatron-LM calls
    optimizer.reload_model_params() there.  The first step runs at lr 0, so the weights after it must be
    the source's, rounded to bf16: transformers' own weights for the converted checkpoint."""
    import torch
    save = sources / f"bf16_{flags[0][2:]}"
    if "partial_bf16" in flags:  # an fp32 run of its own to resume
        _finetune(sources, sources / "partial_bf16", 1, "--pretrained-checkpoint", sources / "base")
    args = [sources / f if f in ("converted", "base", "partial_bf16") else f for f in flags]
    code, out, err = cli_inprocess(*base_args(sources, 3, *SCHEDULE, "--save", save, "--bf16", *args, config=False))
    assert code == 0 and "nan" not in err, err[-2000:]
    first = 2 if "partial_bf16" in flags else 1
    losses = [float(line.split("| lm loss: ")[1].split(" ")[0]) for line in out.splitlines() if "| lm loss: " in line]
    assert len(losses) == 4 - first and all(torch.isfinite(torch.tensor(losses)))
    if flags[1] == "converted":
        megatron_to_hf(save / "iter_0000001", sources / "bf16_back")
        expected = {k: v.to(torch.bfloat16) for k, v in AutoModelForCausalLM.from_pretrained(sources / "hf").state_dict().items()}
        assert_same_weights(AutoModelForCausalLM.from_pretrained(sources / "bf16_back", dtype=torch.bfloat16).state_dict(),
                            expected)
    else:
        source = weights(sources / "base", 2) if "base" in flags else weights(sources / "partial_bf16", 1)
        assert_same_weights(weights(save, first), {k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) else v
                                                   for k, v in source.items()})

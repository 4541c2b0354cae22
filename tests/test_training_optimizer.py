"""Optimizer pieces against their references: the LR schedule against megatron-core's
OptimizerParamScheduler, the dynamic loss scaler against Megatron's rules, parameter groups,
and the batch split against Megatron's pretraining sampler order."""
import pytest
import torch

from hf_megatron.parallel.data_parallel import micro_batches_for_rank
from hf_megatron.training import LossScaler, LRScheduler, TrainingConfig, param_groups
from tiny import tiny_hf_model

import hf_megatron


@pytest.mark.parametrize("style,warmup,decay", [("cosine", 5, 40), ("linear", 3, 20), ("constant", 4, 10),
                                                ("cosine", 0, 30)])
def test_lr_schedule_matches_megatron_core(style, warmup, decay):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    ref_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    ours_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    ref = OptimizerParamScheduler(ref_opt, init_lr=0.0, max_lr=1e-3, min_lr=1e-5, lr_warmup_steps=warmup,
                                  lr_decay_steps=decay, lr_decay_style=style, start_wd=0.1, end_wd=0.1,
                                  wd_incr_steps=1, wd_incr_style="constant")
    ours = LRScheduler(ours_opt, 1e-3, 1e-5, warmup, decay, style)
    for _ in range(decay + 5):  # past the decay horizon: min_lr
        assert ours_opt.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"], rel=1e-12, abs=1e-15)
        ref.step(1)
        ours.step()


def test_scheduler_state_uses_megatron_sample_units():
    """Megatron-LM steps its scheduler by global_batch_size samples per iteration."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    gbs, warmup, decay = 16, 4, 30
    ours = LRScheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), 1e-3, 1e-5, warmup, decay,
                       "cosine", samples_per_iter=gbs)
    for _ in range(11):
        ours.step()
    ref_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    ref = OptimizerParamScheduler(ref_opt, init_lr=0.0, max_lr=1e-3, min_lr=1e-5, lr_warmup_steps=warmup * gbs,
                                  lr_decay_steps=decay * gbs, lr_decay_style="cosine", start_wd=0.0, end_wd=0.0,
                                  wd_incr_steps=1, wd_incr_style="constant", use_checkpoint_opt_param_scheduler=False)
    ref.load_state_dict(ours.state_dict())  # checks max/min lr, warmup, decay and style agree
    assert ref.num_steps == 11 * gbs
    assert ref_opt.param_groups[0]["lr"] == pytest.approx(ours.lr, rel=1e-12)
    back = LRScheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), 1e-3, 1e-5, warmup, decay,
                       "cosine", samples_per_iter=gbs)
    back.load_state_dict(ref.state_dict())
    assert back.num_steps == 11 and back.lr == ours.lr


def test_lr_schedule_rejects_bad_settings():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="lr_decay_style"):
        LRScheduler(opt, 1e-3, decay_style="exp")
    with pytest.raises(ValueError, match="lr_decay_iters"):
        LRScheduler(opt, 1e-3, warmup_iters=10, decay_iters=5, decay_style="cosine")
    with pytest.raises(ValueError, match="min_lr"):
        LRScheduler(opt, 1e-3, min_lr=1e-2)


def test_dynamic_loss_scaler_follows_megatron_hysteresis_and_growth():
    scaler = LossScaler(2.0 ** 16, dynamic=True, hysteresis=2, window=3, min_scale=2.0 ** 14)
    scales = []
    for found_inf in [True, True, False, False, False, True, True, True, True]:
        scaler.update(found_inf)
        scales.append(scaler.scale)
    # 1st inf: hysteresis 2 -> 1, no backoff; 2nd: halve; 3 clean: grow and reset hysteresis;
    # then halves (hysteresis spent after the 2nd inf), floored at min_scale
    assert scales == [2.0 ** 16, 2.0 ** 15, 2.0 ** 15, 2.0 ** 15, 2.0 ** 16, 2.0 ** 16, 2.0 ** 15, 2.0 ** 14, 2.0 ** 14]


def test_no_weight_decay_on_norms_and_biases():
    model = hf_megatron.from_pretrained(tiny_hf_model("gpt2"))
    decay, no_decay = param_groups([model], 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decay["params"])
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert "decoder.final_layernorm.weight" in no_decay_names and "decoder.final_layernorm.bias" in no_decay_names
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in no_decay_names
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_global_batch_split_follows_megatron_sampler_order():
    batch = {"input_ids": torch.arange(12).view(12, 1)}
    # blocks of mbs x dp = 4 samples; dp rank 1 takes the second micro batch of each block
    got = [mb["input_ids"].flatten().tolist() for mb in micro_batches_for_rank(batch, 2, 1, 2)]
    assert got == [[2, 3], [6, 7], [10, 11]]
    with pytest.raises(ValueError, match="not divisible"):
        micro_batches_for_rank(batch, 5, 0, 2)
    with pytest.raises(ValueError, match="global_batch_size"):
        TrainingConfig(micro_batch_size=3, global_batch_size=8).num_micro_batches(dp=1)
    with pytest.raises(ValueError, match="exclusive"):
        TrainingConfig(bf16=True, fp16=True)
    with pytest.raises(ValueError, match="unknown field"):
        TrainingConfig.from_dict({"learning_rate": 1.0})

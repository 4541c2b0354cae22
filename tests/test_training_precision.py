"""Mixed precision: bf16 and fp16 params with fp32 main weights and fp32 gradient accumulation;
fp16 dynamic loss scaling skips a step with an inf/nan gradient on any rank and halves the scale.

Expected scale sequences follow Megatron's DynamicGradScaler rules (backoff 0.5 after
`hysteresis` bad steps, growth x2 after `loss_scale_window` clean steps); the reference losses
come from plain transformers + torch training in fp32 (tests/training_helpers.py).
"""
import torch

from dist import run_distributed
from training_helpers import layer_kwargs, make_batches, our_run, reference_run

STEPS = 8


def test_bf16_trains_like_fp32_with_fp32_main_weights():
    batches = make_batches(STEPS)
    ref_losses, _, _ = reference_run("llama", batches, **layer_kwargs("llama"))
    from hf_megatron.training import build_model, build_optimizer, build_scheduler, setup_parallel, split_batch, \
        train_step
    from tiny import engine_batch, tiny_hf_model
    from training_helpers import training_config
    cfg = training_config({}, bf16=True)
    setup_parallel(cfg)
    chunks = build_model(tiny_hf_model("llama", **layer_kwargs("llama")), cfg)
    optimizer = build_optimizer(chunks, cfg)
    scheduler = build_scheduler(optimizer, cfg)
    assert all(p.dtype == torch.bfloat16 for p in chunks[0].parameters())
    assert all(m.dtype == torch.float32 for m in optimizer.main_params)
    losses = []
    for step, batch in enumerate(batches):
        stats = train_step(chunks, optimizer, scheduler, split_batch(engine_batch(batch), cfg))
        assert not stats["skipped"] and stats["loss_scale"] == 1.0
        losses.append(stats["loss"])
        if step == 0:  # micro-batch gradients were accumulated into fp32 buffers
            assert all(p.main_grad.dtype == torch.float32 and p.grad is None for p in optimizer.model_params)
    # bf16 has an 8-bit mantissa: per-token losses agree to ~1e-2 relative with fp32 training
    for ours, ref in zip(losses, ref_losses):
        assert abs(ours - ref) <= 2e-2 * ref, (losses, ref_losses)
    # the bf16 model weights are the rounded fp32 main weights
    for p, main in zip(optimizer.model_params, optimizer.main_params):
        assert torch.equal(p, main.to(torch.bfloat16))


def fp16_with_injected_inf(rank, world, batches, inf_step):
    """dp=2, fp16; rank 1 alone gets an inf gradient at `inf_step`."""
    from hf_megatron.training import build_model, build_optimizer, build_scheduler, setup_parallel, split_batch, \
        train_step
    from tiny import engine_batch, tiny_hf_model
    from training_helpers import training_config
    cfg = training_config({"dp": 2}, fp16=True, initial_loss_scale=2.0 ** 12, hysteresis=1, loss_scale_window=2,
                          lr_warmup_iters=0)
    setup_parallel(cfg)
    chunks = build_model(tiny_hf_model("llama", **layer_kwargs("llama")), cfg)
    optimizer = build_optimizer(chunks, cfg)
    scheduler = build_scheduler(optimizer, cfg)
    step_now = [0]
    victim = chunks[0].decoder.layers[0].mlp.linear_fc2.weight
    victim.register_hook(lambda g: g * float("inf") if rank == 1 and step_now[0] == inf_step else g)
    out = []
    for step, batch in enumerate(batches):
        step_now[0] = step
        before = [p.detach().clone() for p in optimizer.model_params]
        stats = train_step(chunks, optimizer, scheduler, split_batch(engine_batch(batch), cfg))
        changed = any(not torch.equal(b, p) for b, p in zip(before, optimizer.model_params))
        out.append({**stats, "changed": changed, "scale_after": optimizer.loss_scale,
                    "dtype": str(victim.dtype)})
    return out


def mixed_precision_jobs(rank, world, batches, inf_step):
    """One spawn, two jobs: fp16 llama dp=2 with an injected inf; bf16 gpt2 pp=2 (tied embeddings)."""
    fp16 = fp16_with_injected_inf(rank, world, batches, inf_step)
    from hf_megatron.parallel import state
    state.reset()
    bf16 = our_run("gpt2", {"pp": 2}, batches[:3], bf16=True)
    return {"fp16": fp16, "bf16_pp": {k: bf16[k] for k in ("losses", "state")}}


def test_fp16_inf_gradient_skips_step_and_halves_scale_and_bf16_pipeline_keeps_tied_copies_equal():
    batches = make_batches(5)
    ref_losses, _, _ = reference_run("llama", batches, **layer_kwargs("llama"))
    results = run_distributed(mixed_precision_jobs, 2, (batches, 1))
    per_rank = [r["fp16"] for r in results]
    for stats in per_rank:
        assert [s["dtype"] for s in stats] == ["torch.float16"] * 5
        assert [s["skipped"] for s in stats] == [False, True, False, False, False]
        assert [s["changed"] for s in stats] == [True, False, True, True, True]  # skipped: weights kept
        # scale used by each step: 2^12, 2^12 (inf -> halve), 2^11, 2^11 (2 clean -> grow), 2^12
        assert [s["loss_scale"] for s in stats] == [2.0 ** 12, 2.0 ** 12, 2.0 ** 11, 2.0 ** 11, 2.0 ** 12]
        # what the log shows (Megatron-LM reads get_loss_scale() after train_step): the scaler's value after
        # each step, i.e. already halved on the skipped step's line
        assert [s["next_loss_scale"] for s in stats] == [s["scale_after"] for s in stats]
        assert [s["next_loss_scale"] for s in stats][:4] == [2.0 ** 12, 2.0 ** 11, 2.0 ** 11, 2.0 ** 12]
        # the skipped step does not advance the (decaying) LR schedule
        lrs = [s["lr"] for s in stats]
        assert lrs[0] > lrs[1] == lrs[2] > lrs[3] > lrs[4]
    assert per_rank[0] == per_rank[1]
    # step 0 runs the initial weights: an fp16 forward agrees with fp32 to ~1e-3
    assert abs(per_rank[0][0]["loss"] - ref_losses[0]) <= 2e-3 * ref_losses[0]

    # bf16 with pp=2: the last stage's output-layer copy of the tied embedding got the summed
    # fp32 main grad and the same Adam step, so it equals the first stage's embedding exactly
    first, last = (r["bf16_pp"] for r in results)
    assert torch.equal(first["state"]["embedding.word_embeddings.weight"],
                       last["state"]["output_layer.weight(tied copy)"])
    gpt2_ref, _, _ = reference_run("gpt2", batches[:3], **layer_kwargs("gpt2"))
    for ours, ref in zip(first["losses"], gpt2_ref):
        assert abs(ours - ref) <= 2e-2 * ref

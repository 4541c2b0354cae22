"""Converted checkpoints in a real parallel run (gloo, tp=2 x pp=2): loaded by our checkpoint
loader into the parallel GPTModel they give transformers' logits; saving them again writes the
same files; megatron-core's own GPTModel loads our rank files strictly, and the torch_dist
checkpoint megatron-core writes from them converts back to the original HF tensors; training
resumed from a tp=2 x pp=2 x vpp=2 checkpoint, and from pp=2 x dp=2 with the ZeRO optimizer,
matches the uninterrupted run."""
from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM

from dist import run_distributed
from hf_megatron.conversion.convert import hf_to_megatron, megatron_to_hf
from hf_megatron.checkpoint.unpickle import safe_load
from test_convert_helpers import ARCHS, assert_identical, hf_sources, hf_tensors  # noqa: F401
from tiny import rel_err

IDS = torch.tensor([[3, 17, 250, 9, 41, 128, 77, 5, 299, 0, 64, 12]])


def _mcore_model(config, pp_rank, tp=2, pp=2):
    """megatron-core's GPTModel (local spec, CPU) for a Llama-style config (qk_layernorm: Qwen3;
    rotary_percent: Phi-3's partial rotary)."""
    from megatron.core.models.gpt import GPTModel as McoreGPT
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    mcore_config = TransformerConfig(
        num_layers=config.num_layers, hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_query_groups, kv_channels=config.kv_channels, ffn_hidden_size=config.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=config.norm_epsilon, qk_layernorm=config.qk_layernorm,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=False,
        use_cpu_initialization=True, bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm)
    return McoreGPT(mcore_config, spec, vocab_size=config.padded_vocab_size(tp),
                    max_sequence_length=config.max_position_embeddings, position_embedding_type="rope",
                    rotary_base=config.rotary_base, rotary_percent=config.rotary_percent,
                    share_embeddings_and_output_weights=False,
                    pre_process=pp_rank == 0, post_process=pp_rank == pp - 1)


def _worker(rank, world, megatron_dirs, save_root, torch_dist_root):
    import torch.distributed as dist
    from hf_megatron.checkpoint.load import open_megatron
    from hf_megatron.loading import build_model
    from hf_megatron.parallel import state
    from hf_megatron.training.checkpoint import load_checkpoint, save_checkpoint

    st = state.initialize(tp=2, pp=2)
    pp_rank = st.coords["pp"]
    logits, iterations = {}, {}
    for arch, folder in megatron_dirs.items():
        config = open_megatron(folder).config
        model = build_model(config, stage=pp_rank, num_stages=2).eval()
        iterations[arch] = load_checkpoint(folder, model)
        with torch.no_grad():
            if pp_rank == 0:
                dist.send(model(IDS).hidden_states.contiguous(), dst=rank + 2)
            else:
                hidden = torch.empty(IDS.shape[1], IDS.shape[0], config.hidden_size)
                dist.recv(hidden, src=rank - 2)
                logits[arch] = model(IDS, hidden_states=hidden).logits
        save_checkpoint(f"{save_root}/{arch}", 7, model)

    # megatron-core as the format oracle
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.transformer.enums import AttnBackend
    parallel_state.initialize_model_parallel(2, 2)
    ours = safe_load(f"{megatron_dirs['llama']}/release/mp_rank_{st.coords['tp']:02d}_{pp_rank:03d}/model_optim_rng.pt")
    mcore = _mcore_model(open_megatron(megatron_dirs["llama"]).config, pp_rank)
    result = mcore.load_state_dict(ours["model"], strict=False)
    bad_missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    # a Megatron-LM-style args namespace: no hf_config, no true vocab size, an mcore enum inside
    args = vars(ours["args"]).copy()
    for key in ("hf_config", "vocab_size", "hf_megatron_version"):
        args.pop(key)
    args["attention_backend"] = AttnBackend.auto
    target = f"{torch_dist_root}/iter_0000005"
    if rank == 0:
        import os
        os.makedirs(target)
    dist.barrier()
    # megatron-core's writer assumes CUDA (synchronize, a flag tensor on the current device): CPU stand-ins
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    dist_checkpointing.save({"model": mcore.sharded_state_dict(), "args": argparse.Namespace(**args),
                             "checkpoint_version": 3.0, "iteration": 5}, target)
    if rank == 0:
        with open(f"{torch_dist_root}/latest_checkpointed_iteration.txt", "w") as f:
            f.write("5")
    dist.barrier()
    parallel_state.destroy_model_parallel()

    # resume with the training engine at tp=2 x pp=2 x vpp=2 (model0 / model1 chunks per file)
    from test_checkpoint_resume import model_config, run_and_resume, training_config
    cfg = training_config(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                          virtual_pipeline_model_parallel_size=2)
    uninterrupted, resumed = run_and_resume(cfg, model_config(n_layer=4), f"{save_root}/resume")
    # and with pp=2 x dp=2 and the distributed optimizer (distrib_optim.pt per model-parallel rank)
    cfg = training_config(pipeline_model_parallel_size=2, use_distributed_optimizer=True)
    zero_uninterrupted, zero_resumed = run_and_resume(cfg, model_config(), f"{save_root}/resume_zero")
    return {"logits": logits, "iterations": iterations, "mcore_missing": bad_missing,
            "mcore_unexpected": result.unexpected_keys, "uninterrupted": uninterrupted, "resumed": resumed,
            "zero_uninterrupted": zero_uninterrupted, "zero_resumed": zero_resumed}


def test_parallel_load_save_and_megatron_core_formats(hf_sources, tmp_path):
    dirs = {}
    for arch in ARCHS:
        dirs[arch] = str(tmp_path / f"{arch}_m22")
        hf_to_megatron(hf_sources[arch], dirs[arch], tp=2, pp=2)
    results = run_distributed(_worker, 4, (dirs, str(tmp_path / "saved"), str(tmp_path / "torch_dist")))

    for arch in ARCHS:
        reference = AutoModelForCausalLM.from_pretrained(hf_sources[arch], local_files_only=True).eval()
        with torch.no_grad():
            expected = reference(IDS).logits
        for rank in (2, 3):  # the last stage; both TP ranks return the gathered logits
            assert rel_err(results[rank]["logits"][arch], expected) <= 1e-5, arch
        assert results[0]["iterations"][arch] == 0  # a release checkpoint
        # saving what was loaded writes the same tensors, in the same rank folders
        saved = tmp_path / "saved" / arch
        assert (saved / "latest_checkpointed_iteration.txt").read_text() == "7"
        for rank_dir in sorted((tmp_path / f"{arch}_m22" / "release").iterdir()):
            before = safe_load(rank_dir / "model_optim_rng.pt")["model"]
            after = safe_load(saved / "iter_0000007" / rank_dir.name / "model_optim_rng.pt")
            assert after["checkpoint_version"] == 3.0 and after["iteration"] == 7
            assert_identical(before, after["model"])

    for r in results:
        assert r["mcore_missing"] == [] and r["mcore_unexpected"] == []
        assert r["resumed"] == r["uninterrupted"] and len(set(r["uninterrupted"])) == len(r["uninterrupted"])
        assert r["zero_resumed"] == r["zero_uninterrupted"]
    zero_dir = tmp_path / "saved/resume_zero/iter_0000002/mp_rank_00_001"
    # the distributed optimizer: param groups + scaler in model_optim_rng.pt, main weights and Adam
    # moments of both dp ranks in distrib_optim.pt (Megatron-LM's layout); each with its checksum
    files = ["distrib_optim.pt", "model_optim_rng.pt"]
    assert sorted(p.name for p in zero_dir.iterdir()) == sorted(files + [f + ".sha256" for f in files])
    assert "state" not in safe_load(zero_dir / "model_optim_rng.pt")["optimizer"]["optimizer"]
    resume_file = safe_load(tmp_path / "saved/resume/iter_0000002/mp_rank_01_001/model_optim_rng.pt")
    assert {"model0", "model1", "optimizer", "opt_param_scheduler", "rng_state"} <= set(resume_file)
    assert resume_file["args"].virtual_pipeline_model_parallel_size == 2
    # a training checkpoint (optimizer state, vpp chunks, no tokenizer) converts to HF; --verify
    # compares our model on the checkpoint with transformers on the output
    report = megatron_to_hf(tmp_path / "saved/resume", tmp_path / "resume_hf", verify=True)
    assert report["verify"].top1_agreement == 1.0
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "resume_hf", local_files_only=True).config.n_layer == 4
    # megatron-core's torch_dist checkpoint (common.pt args without hf_config) -> HF tensors
    megatron_to_hf(tmp_path / "torch_dist", tmp_path / "from_torch_dist", vocab_size=300)
    assert_identical(hf_tensors(hf_sources["llama"]), hf_tensors(tmp_path / "from_torch_dist"))

"""float8 linears (parallel/float8.py, `--fp8-format` / `--fp8-recipe`): the flags parse with
Megatron-LM's names, every setup that cannot run is one clear error (no silent bf16 fallback); on a
float8 GPU, the loss and gradients track the bf16 model, and so does `hf-megatron train`.

Tolerance (GPU): e4m3 keeps 3 mantissa bits (relative rounding 2^-4 per element) with one scale per
tensor, so a matmul's output moves by a few percent elementwise; summed into a cross entropy
the loss of a random tiny model stays within 2% of bf16, and each weight gradient points the same
way (cosine similarity >= 0.95) -- a wrong scale or a transposed cast would break both.
"""
import argparse
import json
import sys

import pytest
import torch

from hf_megatron.commands.flags import add_flags, configs_from_args
from hf_megatron.errors import ConfigError
from hf_megatron.training.config import RunConfig, TrainingConfig
from tiny import VOCAB, tiny_hf_model
from train_cli import base_args, cli_inprocess, cli_subprocess, make_workspace

FLOAT8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _model(dtype, device):
    from hf_megatron.loading import build_model
    # hidden 64 / ffn 128 are multiples of 16: every layer linear is eligible
    return build_model(tiny_hf_model("llama"), dtype=dtype, device=device)


def _parse(*argv):
    parser = argparse.ArgumentParser()
    add_flags(parser, RunConfig, TrainingConfig)
    base = ["--hf-config", "nowhere", "--data-path", "nowhere_text_document", "--train-iters", "2"]
    return configs_from_args(parser.parse_args([*base, *argv]), RunConfig, TrainingConfig)[1]


def test_fp8_flags_parse_with_megatron_names():
    assert _parse().fp8_format is None and _parse().fp8_recipe == "tensorwise"  # off by default
    cfg = _parse("--bf16", "--fp8-format", "hybrid")
    assert (cfg.fp8_format, cfg.fp8_recipe) == ("hybrid", "tensorwise")
    cfg = _parse("--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "rowwise")
    assert (cfg.fp8_format, cfg.fp8_recipe) == ("e4m3", "rowwise")
    cfg = _parse("--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "rowwise_with_gw_hp")
    assert (cfg.fp8_format, cfg.fp8_recipe) == ("e4m3", "rowwise_with_gw_hp")
    # accelerate's other_megatron_args reach the same fields
    assert TrainingConfig.from_dict({"bf16": True, "fp8_format": "e4m3"}).fp8_format == "e4m3"
    assert TrainingConfig.from_dict({"bf16": True, "fp8": "hybrid"}).fp8_format == "hybrid"  # Megatron's args.fp8


def test_first_last_layers_bf16_flags_parse_with_megatron_names():
    cfg = _parse("--bf16", "--fp8-format", "hybrid")
    assert (cfg.first_last_layers_bf16, cfg.num_layers_at_start_in_bf16, cfg.num_layers_at_end_in_bf16) == (
        False, 1, 1)  # Megatron-LM's defaults
    cfg = _parse("--bf16", "--fp8-format", "hybrid", "--first-last-layers-bf16", "--num-layers-at-start-in-bf16",
                 "2", "--num-layers-at-end-in-bf16", "0")
    assert (cfg.first_last_layers_bf16, cfg.num_layers_at_start_in_bf16, cfg.num_layers_at_end_in_bf16) == (
        True, 2, 0)


def test_first_last_layers_bf16_selects_those_layers_linears():
    """On a 6-layer model (meta weights): which linears the float8 swap would take."""
    from hf_megatron.loading import build_model
    from hf_megatron.parallel.float8 import _eligible, bf16_layer_numbers
    model = build_model(tiny_hf_model("llama", num_hidden_layers=6), init=False, device="meta")
    linears = [(n, m) for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    keep = bf16_layer_numbers(6, 2, 1)
    assert keep == {0, 1, 5}
    chosen = {n for n, m in linears if _eligible(m, n, keep)}
    layers_chosen = {int(n.split(".")[2]) for n in chosen}
    assert layers_chosen == {2, 3, 4}
    assert all(n.startswith("decoder.layers.") for n in chosen)  # output layer stays bf16
    per_layer = {n for n, _ in linears if n.startswith("decoder.layers.2.")}
    assert per_layer and per_layer <= chosen  # every linear of a float8 layer is taken
    assert bf16_layer_numbers(3, 5, 5) == {0, 1, 2} and bf16_layer_numbers(4, 0, 0) == set()


@pytest.mark.parametrize("argv, fragment", [
    (["--fp8-format", "hybrid"], "--fp8-format hybrid): expected --bf16 as well"),
    (["--fp16", "--fp8-format", "e4m3"], "expected --bf16 as well (float8 linears keep bf16 weights), got --fp16"),
    (["--bf16", "--fp8-format", "hybrid", "--tensor-model-parallel-size", "2"], "expected --tensor-model-parallel"),
    (["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "rowwise"], "use --fp8-format e4m3 with it"),
    (["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "rowwise_with_gw_hp"], "use --fp8-format e4m3 with it"),
    (["--bf16", "--fp8-format", "e5m2"], "(--fp8-format): expected one of e4m3, hybrid, got 'e5m2'"),
    (["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "delayed"], "expected one of tensorwise, rowwise"),
    (["--bf16", "--first-last-layers-bf16"], "(--first-last-layers-bf16): expected --fp8-format as well"),
])
def test_fp8_setup_errors_are_one_line(argv, fragment):
    with pytest.raises(ConfigError) as info:
        _parse(*argv)
    assert fragment in str(info.value) and "\n" not in str(info.value), str(info.value)


@pytest.mark.parametrize("fp8_format, recipe, grad_dtype, granularity", [
    ("hybrid", "tensorwise", "float8_e5m2", "TENSORWISE"),
    ("e4m3", "tensorwise", "float8_e4m3fn", "TENSORWISE"),
    ("e4m3", "rowwise", "float8_e4m3fn", "AXISWISE"),
])
def test_fp8_flags_map_onto_torchao_casts(fp8_format, recipe, grad_dtype, granularity):
    """Megatron's formats: e4m3 activations and weights always; gradients e5m2 (hybrid) or e4m3."""
    pytest.importorskip("torchao")
    from hf_megatron.parallel.float8 import torchao_config
    config = torchao_config(fp8_format, recipe)
    for cast in (config.cast_config_input, config.cast_config_weight):
        assert cast.target_dtype == torch.float8_e4m3fn and cast.scaling_granularity.name == granularity
    for cast in (config.cast_config_grad_output, config.cast_config_grad_output_for_grad_weight):
        assert cast.target_dtype == getattr(torch, grad_dtype) and cast.scaling_granularity.name == granularity


def test_rowwise_with_gw_hp_keeps_the_weight_gradient_gemm_in_high_precision():
    """torchao's recipe: rowwise e4m3 casts for the output and input-gradient GEMMs, none (bf16)
    for the operands of dW = G^T X."""
    pytest.importorskip("torchao")
    from hf_megatron.parallel.float8 import torchao_config
    config = torchao_config("e4m3", "rowwise_with_gw_hp")
    for cast in (config.cast_config_input, config.cast_config_weight, config.cast_config_grad_output):
        assert cast.target_dtype == torch.float8_e4m3fn and cast.scaling_granularity.name == "AXISWISE"
    for cast in (config.cast_config_input_for_grad_weight, config.cast_config_grad_output_for_grad_weight):
        assert cast.scaling_type.name == "DISABLED"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_fp8_without_cuda_is_one_clear_error_before_any_weight_is_read():
    from hf_megatron.loading import build_model
    with pytest.raises(ConfigError, match="float8 training needs the model on a CUDA GPU, got device cpu"):
        build_model(tiny_hf_model("llama"), dtype=torch.bfloat16, fp8=("hybrid", "tensorwise"))
    from hf_megatron.parallel.float8 import apply_float8
    with pytest.raises(ConfigError, match="needs a CUDA GPU with float8 tensor cores"):
        apply_float8(_model(torch.bfloat16, "cpu"))  # the bench's call: no device given


def test_fp8_without_torchao_is_one_clear_error(monkeypatch):
    from hf_megatron.parallel import float8
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao -> ImportError
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ConfigError, match="float8 training needs torchao, which is not importable"):
        float8.check_float8_runs("cuda")


def test_train_cli_refuses_fp8_without_bf16_in_one_line(tmp_path):
    code, _, err = cli_inprocess(*base_args(make_workspace(tmp_path), 1, "--fp8-format", "hybrid"))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "--fp8-format hybrid): expected --bf16" in lines[0], err


@pytest.mark.gpu
@pytest.mark.skipif(not FLOAT8_GPU, reason="needs a GPU with float8 tensor cores (sm89+)")
def test_train_with_fp8_tracks_bf16(tmp_path):
    pytest.importorskip("torchao")
    root = make_workspace(tmp_path)
    summaries = {}
    for name, extra in (("bf16", ()), ("fp8", ("--fp8-format", "hybrid")), ("fp8c", ("--fp8-format", "e4m3",
                                                                                     "--torch-compile"))):
        code, out, err = cli_subprocess(*base_args(root, 8, "--bf16", "--save", tmp_path / name, *extra),
                                        timeout=600)
        assert code == 0, err[-2000:]
        summaries[name] = json.loads((tmp_path / name / "training_summary.json").read_text())
    for name in ("fp8", "fp8c"):
        assert summaries[name]["iterations"] == 8
        for key in ("first_loss", "final_loss"):  # same 2% as the model-level check below
            assert summaries[name][key] == pytest.approx(summaries["bf16"][key], rel=0.02), (name, key, summaries)


@pytest.mark.gpu
@pytest.mark.skipif(not FLOAT8_GPU, reason="needs a GPU with float8 tensor cores (sm89+)")
@pytest.mark.parametrize("compiled", [False, True])
def test_float8_tracks_bf16(compiled):
    pytest.importorskip("torchao")
    from hf_megatron.parallel.compile import apply_compile
    from hf_megatron.parallel.float8 import apply_float8
    ids = torch.randint(0, VOCAB, (4, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    results = []
    for float8 in (False, True):
        model = _model(torch.bfloat16, "cuda")
        if float8:
            apply_float8(model)
            converted = [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
            assert len(converted) == 2 * 4, converted  # qkv, proj, fc1, fc2 in each of 2 layers
        if compiled:
            apply_compile(model)
        out = model(input_ids=ids, labels=ids, return_logits=False)
        out.loss.backward()
        grads = {n: p.grad.float().flatten() for n, p in model.named_parameters() if p.grad is not None}
        results.append((out.loss.item(), grads))
    (loss_bf16, grads_bf16), (loss_f8, grads_f8) = results
    assert abs(loss_f8 - loss_bf16) <= 0.02 * loss_bf16, (loss_f8, loss_bf16)
    assert grads_f8.keys() == grads_bf16.keys()
    for name in grads_bf16:
        cos = torch.nn.functional.cosine_similarity(grads_f8[name], grads_bf16[name], dim=0).item()
        assert cos >= 0.95, (name, cos)


@pytest.mark.gpu
@pytest.mark.skipif(not FLOAT8_GPU, reason="needs a GPU with float8 tensor cores (sm89+)")
def test_first_last_layers_bf16_keeps_those_layers_out_of_float8():
    pytest.importorskip("torchao")
    from hf_megatron.loading import build_model
    model = build_model(tiny_hf_model("llama", num_hidden_layers=3), dtype=torch.bfloat16, device="cuda",
                        fp8=("hybrid", "tensorwise"), fp8_bf16_layers=(1, 1))
    converted = {n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    assert {int(n.split(".")[2]) for n in converted} == {1} and len(converted) == 4, converted

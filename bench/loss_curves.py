"""20-step loss curves of the Llama 1.2B under each speed option, against the default (bf16).

    python bench/loss_curves.py --out curves.json            # one H200: the 1.2B of bench/throughput.py
    python bench/loss_curves.py --device cpu --tiny          # dry run (tiny config; float8 rows skipped)

Every option trains hf_megatron's model from the same initial weights (bench/throughput.py's
`hf_model`: transformers' init drawn with seed 0, converted by `build_model`) on the same batches,
with TrainingConfig(bf16=True) -- bf16 weights, fp32 main weights and grads -- plus the option:

    default                      nothing else (on CUDA that compiles each layer: the default since session 8;
                                 before it, the default curve was eager)
    default (again)              the same run repeated: the run-to-run noise floor (non-deterministic
                                 GPU kernels, e.g. atomics in the attention and embedding backward)
    default (perturbed init)     the default with every initial weight w replaced by w (1 + 1e-3 z),
                                 z ~ N(0, 1) (seed 0): how far the bf16 curve itself moves when its
                                 start moves by about what float8's first step does (its step-1 loss
                                 differed by 4e-4 in session 5) -- the floor a per-step bound can see
    torch-compile                --torch-compile (each layer and the loss compiled; on CUDA the default)
    no-torch-compile             --no-torch-compile (eager)
    cross-entropy-loss-fusion    --cross-entropy-loss-fusion (output layer + loss in chunks)
    fp8-format hybrid            --fp8-format hybrid --fp8-recipe tensorwise (torchao float8 linears)
    fp8-format e4m3              --fp8-format e4m3 --fp8-recipe tensorwise (gradients in e4m3 too: one
                                 more mantissa bit than hybrid's e5m2, less range)
    fp8-recipe rowwise           --fp8-format e4m3 --fp8-recipe rowwise (a scale per row)
    fp8-recipe rowwise_with_gw_hp  --fp8-format e4m3 --fp8-recipe rowwise_with_gw_hp (rowwise, the
                                 weight-gradient GEMM in bf16)
    fp8 first-last-layers-bf16   fp8-format hybrid, --first-last-layers-bf16 (first and last layer in bf16)
    fp8 first-layer-bf16         the same with --num-layers-at-end-in-bf16 0 (only the first layer in bf16)
    fp8 last-layer-bf16          the same with --num-layers-at-start-in-bf16 0 (only the last layer in bf16)
    fp8 no-fast-accum            fp8-format hybrid with torchao's forward GEMM accumulating exactly (its
                                 default, as Transformer Engine's fprop, is cuBLAS fast accumulation: the
                                 float8 products summed in lower precision); no CLI flag, bench only
    fp8 pow2-scales              fp8-format hybrid with every scale rounded down to a power of two
                                 (torchao's round_scales_to_power_of_2: scaling and unscaling exact); bench only
    all                          the three together (bench/throughput.py's ours-float8+fused-ce)
    gradient-accumulation-fusion --gradient-accumulation-fusion, when TrainingConfig has that field
                                 (Megatron-LM's name); otherwise the row says it is absent
    torch-adamw                  torch's fused AdamW instead of csrc/adamw.cu (the default's AdamW on
                                 CUDA since session 7; the same as default elsewhere)
    exp-avg-dtype bf16           --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 (moments kept in bf16)
    hf bf16                      the anchor of the float8 question, without our code: transformers' model
                                 from the same weights, bf16 autocast over fp32 weights, torch's fused
                                 AdamW (weight decay on matrices only, the same lr schedule and clip), the
                                 loss computed from its logits on the same targets
    hf fp8-format hybrid         hf bf16 with torchao's own convert_to_float8_training (tensorwise scales,
                                 lm_head left in bf16): how far float8 moves a curve in torchao's intended
                                 use; compared with "hf bf16", not with "default"

Data (`--data`): "text" (default) is real text: the Python standard library's own .py sources
(docstrings, comments and code; files in sorted order from `sysconfig`'s stdlib folder) split into
words and punctuation by the regex  \\w+|[^\\w\\s] , each piece mapped to the id
crc32(piece) mod vocab -- a Zipf-like, context-structured stream over the whole vocabulary that a
model learns from within a few steps (random tokens give a flat curve at ln(vocab)).  It depends
on the Python version, the same for every option of one run.  "zipf" is a fixed seeded stream
instead: ids drawn i.i.d. from a Zipf law (exponent 1.1, seed 0) -- learnable only as unigram
statistics.  Step n uses windows n*b .. n*b+b-1 of seq+1 tokens (inputs = window[:-1],
targets = window[1:]).

Optimiser: AdamW, lr `--lr` (default 3e-4) after a linear warmup of `--warmup-iters` steps
(default 2), constant after,
clip 1.0, weight decay 0.01.  Per option the table lists the loss of each step (the loss the
step computes, before its update) and  max_n |L_option(n) - L_default(n)| / L_default(n);
an option passes when that is <= `--tolerance` (default 1%, the issue's bound).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
import sys
import sysconfig
import zlib
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput  # noqa: E402  (its model specs, model builder and memory cleanup)
from provenance import header, provenance  # noqa: E402

BASE = dict(bf16=True, clip_grad=1.0, weight_decay=0.01, lr_warmup_iters=2, lr_decay_style="constant")
OPTIONS = {
    "default": {},
    "default (again)": {},
    "default (perturbed init)": {"_perturb": 1e-3},
    "torch-compile": {"torch_compile": True},
    "no-torch-compile": {"torch_compile": False},
    "cross-entropy-loss-fusion": {"cross_entropy_loss_fusion": True},
    "fp8-format hybrid": {"fp8_format": "hybrid", "fp8_recipe": "tensorwise"},
    "fp8-format e4m3": {"fp8_format": "e4m3", "fp8_recipe": "tensorwise"},
    "fp8-recipe rowwise": {"fp8_format": "e4m3", "fp8_recipe": "rowwise"},
    "fp8-recipe rowwise_with_gw_hp": {"fp8_format": "e4m3", "fp8_recipe": "rowwise_with_gw_hp"},
    "fp8 first-last-layers-bf16": {"fp8_format": "hybrid", "fp8_recipe": "tensorwise", "first_last_layers_bf16": True},
    "fp8 first-layer-bf16": {"fp8_format": "hybrid", "fp8_recipe": "tensorwise", "first_last_layers_bf16": True,
                             "num_layers_at_end_in_bf16": 0},
    "fp8 last-layer-bf16": {"fp8_format": "hybrid", "fp8_recipe": "tensorwise", "first_last_layers_bf16": True,
                            "num_layers_at_start_in_bf16": 0},
    "fp8 no-fast-accum": {"fp8_format": "hybrid", "fp8_recipe": "tensorwise", "_fp8_tweak": "no-fast-accum"},
    "fp8 pow2-scales": {"fp8_format": "hybrid", "fp8_recipe": "tensorwise", "_fp8_tweak": "pow2-scales"},
    "all": {"torch_compile": True, "cross_entropy_loss_fusion": True, "fp8_format": "hybrid"},
    "gradient-accumulation-fusion": {"gradient_accumulation_fusion": True},
    "torch-adamw": {"_torch_adamw": True},
    "exp-avg-dtype bf16": {"use_precision_aware_optimizer": True, "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"},
    "hf bf16": {"_hf": "bf16"},
    "hf fp8-format hybrid": {"_hf": "fp8"},
}
HF_REFERENCE = "hf bf16"  # what the "hf ..." rows are compared with
WORD = re.compile(r"\w+|[^\w\s]")


def text_tokens(vocab: int, count: int) -> np.ndarray:
    """`count` ids from the standard library's sources (see the module docstring); repeated from the
    start if the sources run out."""
    ids: list[int] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        words = WORD.findall(path.read_text(encoding="utf-8", errors="replace"))
        ids.extend(zlib.crc32(w.encode()) % vocab for w in words)
        if len(ids) >= count:
            break
    return np.resize(np.asarray(ids, dtype=np.int64), count)


def zipf_tokens(vocab: int, count: int) -> np.ndarray:
    draws = np.random.default_rng(0).zipf(1.1, size=count)
    return (draws - 1) % vocab


def batches(spec, steps: int, data: str, device: str) -> list[dict]:
    vocab = throughput.hf_config(spec).vocab_size
    count = steps * spec.batch * (spec.seq + 1)
    tokens = (text_tokens if data == "text" else zipf_tokens)(vocab, count)
    windows = torch.from_numpy(tokens).view(steps, spec.batch, spec.seq + 1).to(device)
    return [{"input_ids": w[:, :-1].contiguous(), "targets": w[:, 1:].contiguous()} for w in windows]


def perturbed(model: torch.nn.Module, relative: float) -> torch.nn.Module:
    """Every weight w -> w (1 + relative z), z ~ N(0, 1) from a fixed seed, in place."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + relative * torch.randn(p.shape, generator=gen).to(p.device, p.dtype))
    return model


def run_option(spec, fields: dict, data: list[dict], lr: float, device: str, warmup: int = 2) -> list[float]:
    """The step losses of one option (raises ConfigError where the option cannot run here); a
    field "_perturb" perturbs the initial weights (see `perturbed`), "_torch_adamw" steps with
    torch's fused AdamW (MixedPrecisionOptimizer.precision_aware = False) instead of configuring."""
    fields = dict(fields)
    perturb, torch_adamw = fields.pop("_perturb", None), fields.pop("_torch_adamw", False)
    tweak = fields.pop("_fp8_tweak", None)
    if tweak:
        return _with_fp8_tweak(tweak, run_option, spec, fields, data, lr, device, warmup)
    from hf_megatron.parallel import state
    from hf_megatron.training import TrainingConfig, build_model, build_optimizer, setup_parallel, train_step
    from hf_megatron.training.trainer import build_scheduler
    cfg = TrainingConfig(micro_batch_size=spec.batch, global_batch_size=spec.batch, lr=lr,
                         train_iters=len(data), **{**BASE, "lr_warmup_iters": warmup}, **fields)
    setup_parallel(cfg)
    try:
        source = throughput.hf_model(spec, device)  # seeded: the same initial weights for every option
        if perturb:
            perturbed(source, perturb)
        chunks = build_model(source, cfg, device=device)
        del source
        optimizer = build_optimizer(chunks, cfg)
        if torch_adamw:
            optimizer.precision_aware = False
        scheduler = build_scheduler(optimizer, cfg)
        return [float(train_step(chunks, optimizer, scheduler, [batch])["loss"]) for batch in data]
    finally:
        state.reset()


def _with_fp8_tweak(tweak: str, run, *args):
    """`run(*args)` with torchao's Float8LinearConfig changed by `tweak` (see the option list)."""
    from torchao.float8.config import Float8GemmConfig

    from hf_megatron.parallel import float8
    original = float8.torchao_config
    changes = {"no-fast-accum": {"gemm_config_output": Float8GemmConfig(use_fast_accum=False)},
               "pow2-scales": {"round_scales_to_power_of_2": True}}[tweak]
    float8.torchao_config = lambda *a, **k: dataclasses.replace(original(*a, **k), **changes)
    try:
        return run(*args)
    finally:
        float8.torchao_config = original


def run_hf(spec, precision: str, data: list[dict], lr: float, device: str, warmup: int = 2) -> list[float]:
    """The step losses of transformers' model trained without our code (see "hf bf16" in the module
    docstring); `precision` "fp8": torchao's float8 training on every linear but lm_head."""
    model = throughput.hf_model(spec, device)
    model.train()
    if precision == "fp8":
        from torchao.float8 import convert_to_float8_training
        convert_to_float8_training(model, module_filter_fn=lambda module, fqn: fqn != "lm_head")
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": BASE["weight_decay"]},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=lr, fused=device.startswith("cuda"))
    losses = []
    for n, batch in enumerate(data):
        for group in optimizer.param_groups:  # Megatron's warm-up: step n runs at lr * n / W
            group["lr"] = lr * min(n / warmup, 1.0) if warmup else lr
        with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
            logits = model(input_ids=batch["input_ids"]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch["targets"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, BASE["clip_grad"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


def measure(spec, args) -> dict[str, dict]:
    from hf_megatron.errors import HFMegatronError
    from hf_megatron.training import TrainingConfig
    fields_known = {f.name for f in dataclasses.fields(TrainingConfig)}
    data = batches(spec, args.steps, args.data, args.device)
    results = {}
    for name in args.options:
        fields = OPTIONS[name]
        missing = sorted(set(fields) - fields_known - {"_perturb", "_torch_adamw", "_hf", "_fp8_tweak"})
        if missing:
            results[name] = {"skipped": f"TrainingConfig has no field {', '.join(missing)} on this branch"}
        else:
            throughput.free_memory(args.device)
            try:
                run = functools.partial(run_hf, spec, fields["_hf"]) if "_hf" in fields else \
                    functools.partial(run_option, spec, fields)
                results[name] = {"losses": run(data, args.lr, args.device, args.warmup_iters)}
            except HFMegatronError as error:  # e.g. float8 without a float8 GPU: one line, said in the table
                results[name] = {"skipped": str(error)}
            except Exception as error:  # out of memory, compile failure: a row, not a crash
                results[name] = {"error": f"{type(error).__name__}: {str(error).strip()[:200]}"}
            finally:
                throughput.free_memory(args.device)
        print(json.dumps({"option": name, **results[name]}), flush=True)
    return results


def compare(results: dict[str, dict], tolerance: float) -> None:
    """Adds max_rel_diff (vs "default", or vs "hf bf16" for the "hf ..." rows) and passed to every
    option that ran."""
    for name, row in results.items():
        reference = results.get(HF_REFERENCE if name.startswith("hf ") else "default", {}).get("losses")
        if reference and "losses" in row:
            row["max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(row["losses"], reference))
            row["passed"] = row["max_rel_diff"] <= tolerance


def markdown(results: dict[str, dict], tolerance: float) -> str:
    ran = [name for name, row in results.items() if "losses" in row]
    lines = ["| step | " + " | ".join(ran) + " |", "| --- |" + " --- |" * len(ran)]
    steps = len(results[ran[0]]["losses"]) if ran else 0
    for n in range(steps):
        lines.append(f"| {n + 1} | " + " | ".join(f"{results[name]['losses'][n]:.4f}" for name in ran) + " |")
    lines.append("| max rel diff vs default (hf rows: vs hf bf16) | " + " | ".join(
        f"{results[name].get('max_rel_diff', float('nan')):.2e}" for name in ran) + " |")
    lines.append(f"| within {tolerance:.0%} | " + " | ".join(
        ("pass" if results[name].get("passed") else "FAIL") for name in ran) + " |")
    notes = [f"{name}: {'skipped' if 'skipped' in row else 'error'}: {row.get('skipped', row.get('error'))}"
             for name, row in results.items() if "losses" not in row]
    return "\n".join(lines + ([""] + notes if notes else []))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(throughput.MODELS), default="llama-1b")
    parser.add_argument("--options", nargs="+", choices=list(OPTIONS), default=list(OPTIONS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--data", choices=("text", "zipf"), default="text")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup-iters", type=int, default=2, help="linear lr warm-up steps (default 2)")
    parser.add_argument("--tolerance", type=float, default=0.01)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the model's tiny config (a CPU dry run)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default: the model's)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    spec = throughput.spec_of(args.model, args.tiny, args.batch)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    record = provenance()
    print(header(record), flush=True)
    print(f"device {device_name}; model {args.model}{' (tiny)' if args.tiny else ''}, batch {spec.batch} x seq "
          f"{spec.seq}, {args.steps} steps, data {args.data}, lr {args.lr}, warm-up {args.warmup_iters} steps", flush=True)
    results = measure(spec, args)
    compare(results, args.tolerance)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": device_name, "model": args.model, "tiny": args.tiny,
                                              "batch": spec.batch, "seq": spec.seq, "data": args.data,
                                              "lr": args.lr, "warmup_iters": args.warmup_iters, **record,
                                              "results": results}, indent=1))
    print(markdown(results, args.tolerance))


if __name__ == "__main__":
    main()

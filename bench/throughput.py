"""Single-GPU training throughput, transformers vs hf_megatron, eager vs torch.compile, in one run.

    python bench/throughput.py --out results.json                       # 3 models x 8 variants, one H200
    python bench/throughput.py --models llama-1b --variants ours ours-compile
    python bench/throughput.py --device cpu --tiny                      # dry run (tiny configs, 1 step)

Models (random weights, from transformers configs built directly; dropout 0):
    gpt2-medium  355M   batch 16 x seq 1024
    gpt2-xl      1.5B   batch  8 x seq 1024
    llama-1b     1.2B   hidden 2048, 16 layers, 32 heads / 8 KV heads, ffn 8192, vocab 128256, tied;
                        batch 8 x seq 2048
    llama-3b     3.6B   bench/bench_parallel.py's "3b": hidden 3072, 28 layers, 24 heads / 8 KV heads,
                        ffn 8192, vocab 128256, untied; batch 2 x seq 4096 (not in the default list:
                        `--models llama-3b`, for the float8 row)
The 3B batch, estimated for one 141 GB H200 (~139 GiB usable): weights + optimizer state are
3.61e9 params x 18 B (ours: bf16 weights, fp32 main weights and main grads, Adam m and v) =
60.5 GiB, or x 16 B (transformers: fp32 weights and grads, Adam) + 6 GiB of autocast bf16 weight
copies = 60 GiB; activations, scaled from the measured 1.2B rows (logits ~1.2 MiB/token at vocab
128256, layers x1.75 for 28 vs 16 layers and x1.15 for the wider hidden) and from
bench_parallel's 3B at one 4096-token sequence (78.6 GiB), are ~4.6 MiB/token (ours) and
~5.3 MiB/token (transformers eager).  Batch 2 (8192 tokens): ~98 / ~102 GiB; batch 3: ~116 /
~123 GiB; batch 4 does not fit.  2 keeps every variant, eager included, clear of the limit;
`--batch 3` tries more.
Variants (one train step = forward, backward, clip 1.0, AdamW; targets = the ids shifted by one):
    hf-eager      transformers, fp32 weights under bf16 autocast, SDPA, fused torch AdamW
    hf-compile    the same, the whole model compiled (`model.compile()`)
    ours          hf_megatron: TrainingConfig(bf16=True) -- bf16 weights, fp32 main weights and grads --
                  build_model from the transformers model object, build_optimizer, train_step
    hf-liger      hf-eager with liger-kernel's patches on the model instance (RMSNorm, SwiGLU, rope,
                  fused linear cross entropy); Llama only (liger has no GPT-2 patch: the row says so)
    ours-compile  the same with build_model(..., compile=True): each layer and the loss compiled
    ours-fused-ce ours-compile with the output layer + cross entropy in chunks (parallel/linear_loss.py)
    ours-float8   ours-compile with the layers' linears in torchao float8: TrainingConfig(fp8_format=
                  "hybrid", fp8_recipe="tensorwise"), i.e. `train --fp8-format hybrid` (parallel/float8.py);
                  the loss stays the default one (before session 11 this variant also had the fused
                  loss, ours-float8+fused-ce now: bench/RESULTS.md)
    ours-wgrad-fusion  ours-compile with --gradient-accumulation-fusion: the layers' weight-gradient
                  GEMMs accumulate into the fp32 main grads (parallel/wgrad.py)
    ours-compile-full-buffer  ours-compile with the fp32 grad buffer allocated up front and every
                  backward folded into it, and torch's fused AdamW (session 5's step)
    ours-torch-adamw  ours-compile with torch's fused AdamW on the widened grads and a cast back (session
                  6's step) instead of csrc/adamw.cu, which by default on CUDA reads the bf16 grads and
                  writes the bf16 weights in the same pass (training/fused_adamw.py)
    ours-compile-decoder  ours-compile with --torch-compile-scope decoder: the whole decoder stack one
                  compiled region (parallel/compile.py)
    ours-compile-deferred  ours-compile stepped as `train --defer-step-stats` steps: each step read after
                  the next one's forward and backward are queued (training/deferred.py)
    ours-compile-budget-0.8, ours-compile-budget-0.5  ours-compile with --activation-memory-budget 0.8 /
                  0.5: the partitioner recomputes the cheapest activations instead of saving them
    ours-X+M+...  an ours-* variant with more options (MODIFIERS: +fused-ce +float8 +wgrad-fusion
                  +torch-adamw +decoder +deferred +bf16-moments (--exp-avg-dtype / --exp-avg-sq-dtype bf16),
                  +bf16-ends (with +float8: --first-last-layers-bf16, the first and last layer's linears in
                  bf16), +torch-swiglu (PyTorch's silu(gate) * up instead of the csrc op, so that inductor can
                  fuse it with float8's amax and casts), or +budget-B), e.g. ours-compile+deferred+decoder, ours-float8+bf16-ends

Timing: `--warmup` steps (the first one includes compilation, reported on its own), then
`--steps` timed steps between torch.cuda.synchronize calls.  Model FLOPs per token
    6 x (matmul parameters, output layer included even when tied) + 12 x layers x hidden x seq
(forward + backward; attention scores counted over the full s x s square, PaLM's convention),
MFU = tokens/s x FLOPs per token / the bf16 matmul peak measured in this run (bench/matmul_peak.py).
Peak memory is torch.cuda.max_memory_allocated over the steps (weights, optimizer state and
activations; the transformers copy that hf_megatron's variants are built from is gone by then).
The last column is the mean SM clock (MHz) and board power (W) over the timed steps, read through
NVML (bench/gpu_clocks.py; the JSON adds the share of samples at the software power cap): at the
power cap the clock moves by up to ~30% (session 12), one source of the spread between two calls.
A variant that fails (out of memory, compile error) becomes a row with its error.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_clocks import ClockSampler  # noqa: E402
from matmul_peak import measure_bf16_peak  # noqa: E402
from provenance import header, provenance  # noqa: E402

VARIANTS = ("hf-eager", "hf-compile", "hf-liger", "ours", "ours-compile", "ours-fused-ce", "ours-float8",
            "ours-wgrad-fusion", "ours-compile-full-buffer", "ours-torch-adamw", "ours-compile-decoder",
            "ours-compile-deferred", "ours-compile-budget-0.8", "ours-compile-budget-0.5")
LIGER = {"llama": "apply_liger_kernel_to_llama"}  # liger-kernel has no GPT-2 patch
NO_DROPOUT = {"gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), "llama": {}}


@dataclass
class Spec:
    family: str  # gpt2 | llama
    batch: int
    seq: int
    config: dict  # transformers config fields


MODELS = {
    "gpt2-medium": Spec("gpt2", 16, 1024, dict(n_embd=1024, n_layer=24, n_head=16)),
    "gpt2-xl": Spec("gpt2", 8, 1024, dict(n_embd=1600, n_layer=48, n_head=25)),
    "llama-1b": Spec("llama", 8, 2048, dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                                            num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
                                            tie_word_embeddings=True, rope_theta=500000.0)),
    # bench/bench_parallel.py's MODELS["3b"] (its ModelConfig: rope 500000, norm eps 1e-5, untied)
    "llama-3b": Spec("llama", 2, 4096, dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24,
                                            num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
                                            tie_word_embeddings=False, rope_theta=500000.0, rms_norm_eps=1e-5)),
}
DEFAULT_MODELS = ("gpt2-medium", "gpt2-xl", "llama-1b")  # the table; llama-3b on request
TINY = {  # same families, CPU-sized
    "gpt2-medium": Spec("gpt2", 2, 32, dict(n_embd=64, n_layer=2, n_head=4, vocab_size=300, bos_token_id=0,
                                            eos_token_id=0)),
    "gpt2-xl": Spec("gpt2", 2, 32, dict(n_embd=80, n_layer=3, n_head=5, vocab_size=300, bos_token_id=0,
                                        eos_token_id=0)),
    "llama-1b": Spec("llama", 2, 32, dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=128, vocab_size=300,
                                          tie_word_embeddings=True)),
    "llama-3b": Spec("llama", 2, 64, dict(hidden_size=96, num_hidden_layers=3, num_attention_heads=6,
                                          num_key_value_heads=2, intermediate_size=128, vocab_size=300,
                                          tie_word_embeddings=False, rms_norm_eps=1e-5)),
}


def spec_of(name: str, tiny: bool, batch: int | None = None) -> Spec:
    """The model's Spec (its tiny twin with `tiny`), the batch replaced by `batch` when given."""
    spec = (TINY if tiny else MODELS)[name]
    return spec if batch is None else Spec(spec.family, batch, spec.seq, spec.config)


def hf_config(spec: Spec):
    from transformers import GPT2Config, LlamaConfig
    if spec.family == "gpt2":
        return GPT2Config(n_positions=spec.seq, **NO_DROPOUT["gpt2"], **spec.config)
    return LlamaConfig(max_position_embeddings=spec.seq, **spec.config)


def hf_model(spec: Spec, device: str):
    """The transformers model, fp32, random weights drawn on `device` (same seed for every variant)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(hf_config(spec), attn_implementation="sdpa")


def flops_per_token(spec: Spec) -> float:
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D
    config = hf_config(spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    matmul_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, (torch.nn.Linear, Conv1D)))
    return 6 * matmul_params + 12 * config.num_hidden_layers * config.hidden_size * spec.seq


def hf_step(spec: Spec, device: str, compile: bool, compile_mode: str | None, ids: torch.Tensor, lr: float = 1e-5,
            liger: bool = False):
    model = hf_model(spec, device)
    model.train()
    if liger:
        if spec.family not in LIGER:
            raise NotImplementedError(f"liger-kernel has no patch for {spec.family}")
        import liger_kernel.transformers as liger_kernel
        getattr(liger_kernel, LIGER[spec.family])(model=model)
    if compile:
        model.compile(mode=compile_mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)

    def step() -> torch.Tensor:
        with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss  # transformers shifts the labels
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step, None


def session5_optimizer(chunks, cfg):
    """build_optimizer as of session 5: the fp32 grad buffer allocated up front and every backward
    folded into it (no lazy buffer, grad_buffer.py), torch's fused AdamW + cast back (no csrc AdamW)."""
    from hf_megatron.training import build_optimizer
    from hf_megatron.training.optimizer import MixedPrecisionOptimizer
    lazy = MixedPrecisionOptimizer._lazy_grad_buffer
    MixedPrecisionOptimizer._lazy_grad_buffer = lambda self: False
    try:
        optimizer = build_optimizer(chunks, cfg)
    finally:
        MixedPrecisionOptimizer._lazy_grad_buffer = lazy
    optimizer.precision_aware = False
    return optimizer


def ours_step(spec: Spec, device: str, compile: bool, compile_mode: str | None, ids: torch.Tensor, lr: float = 1e-5,
              float8: bool = False, fused_loss: bool = False, wgrad_fusion: bool = False, full_buffer: bool = False,
              torch_adamw: bool = False, scope: str = "layer", deferred: bool = False,
              memory_budget: float | None = None, bf16_moments: bool = False, torch_ce: bool = False,
              bf16_ends: bool = False, torch_swiglu: bool = False):
    from hf_megatron.model.gpt import shift_labels
    from hf_megatron.parallel import state
    from hf_megatron.training import TrainingConfig, build_model, build_optimizer, setup_parallel, train_step
    cfg = TrainingConfig(micro_batch_size=spec.batch, global_batch_size=spec.batch, lr=lr, bf16=True, clip_grad=1.0,
                         fp8_format="hybrid" if float8 else None, first_last_layers_bf16=bf16_ends,
                         gradient_accumulation_fusion=wgrad_fusion, use_precision_aware_optimizer=bf16_moments,
                         exp_avg_dtype="bf16" if bf16_moments else "fp32",
                         exp_avg_sq_dtype="bf16" if bf16_moments else "fp32")
    if torch_ce:  # the loss as PyTorch's cross entropy (compiled) instead of csrc/cross_entropy.cu; each
        from hf_megatron.kernels import cross_entropy  # variant runs in its own process
        cross_entropy.kernel_fits = lambda *args: False
    if torch_swiglu:  # SwiGLU as PyTorch's silu(gate) * up (inductor fuses it, with float8 also with the casts'
        from hf_megatron import kernels  # amax and scaling) instead of the csrc custom op
        kernels.swiglu = kernels.swiglu_reference
    setup_parallel(cfg)  # one process: a 1 x 1 x 1 grid, no process group
    try:
        source = hf_model(spec, device)
        # float8 (cfg.fp8_format): build_model swaps the float8 linears in before the regional compile
        chunks = build_model(source, cfg, device=device, fused_loss=fused_loss,
                             compile={"mode": compile_mode, "scope": scope, "memory_budget": memory_budget}
                             if compile else False)
        del source
        optimizer = session5_optimizer(chunks, cfg) if full_buffer else build_optimizer(chunks, cfg)
        if torch_adamw:  # torch's fused AdamW + cast back instead of csrc/adamw.cu
            optimizer.precision_aware = False
    except BaseException:
        state.reset()
        raise
    micro_batches = [{"input_ids": ids, "targets": shift_labels(ids)}]
    if deferred:
        from hf_megatron.training.deferred import DeferredSteps
        runner = DeferredSteps(chunks, optimizer, None)

        def step() -> float:  # the previous step's loss (nan on the first call)
            stats = runner.step(micro_batches)
            return stats["loss"] if stats is not None else float("nan")

        def flush() -> float | None:  # launch and read the step queued last, if any
            stats = runner.finish()
            return None if stats is None else stats["loss"]

        step.flush = flush
        return step, state.reset

    def step() -> float:
        return train_step(chunks, optimizer, None, micro_batches)["loss"]

    return step, state.reset


MODIFIERS = {  # "+name" after an ours-* variant: its options on top (e.g. ours-compile+deferred+decoder)
    "fused-ce": {"fused_loss": True}, "float8": {"float8": True},
    "wgrad-fusion": {"wgrad_fusion": True}, "torch-adamw": {"torch_adamw": True}, "decoder": {"scope": "decoder"},
    "deferred": {"deferred": True}, "bf16-moments": {"bf16_moments": True}, "full-buffer": {"full_buffer": True},
    "torch-ce": {"torch_ce": True}, "bf16-ends": {"bf16_ends": True}, "torch-swiglu": {"torch_swiglu": True}}
NAMED = {  # the named ours-* variants as ours-compile + modifiers
    "ours-fused-ce": "fused-ce", "ours-float8": "float8", "ours-wgrad-fusion": "wgrad-fusion",
    "ours-compile-full-buffer": "full-buffer", "ours-torch-adamw": "torch-adamw", "ours-compile-decoder": "decoder",
    "ours-compile-deferred": "deferred", "ours-compile-budget-0.8": "budget-0.8", "ours-compile-budget-0.5": "budget-0.5"}


def _modifier(name: str) -> dict:
    """ours_step's options of one "+name" (MODIFIERS, or budget-B with 0 < B < 1); KeyError / ValueError."""
    if not name.startswith("budget-"):
        return MODIFIERS[name]
    budget = float(name[len("budget-"):])
    if not 0 < budget < 1:
        raise ValueError(name)
    return {"memory_budget": budget}


def ours_options(variant: str) -> dict:
    """ours_step's options of an ours-* variant: "ours" (eager) or "ours-compile", or a NAMED one, then
    its "+modifier"s applied in order."""
    base, *extra = variant.split("+")
    if base in NAMED:
        base, extra = "ours-compile", [NAMED[base], *extra]
    options = dict(compile=base != "ours")
    for name in extra:
        options.update(_modifier(name))
    return options


def variant_name(text: str) -> str:
    """argparse type: one of VARIANTS, or an ours-* one followed by "+modifier"s."""
    base, *extra = text.split("+")
    try:
        ok = base in VARIANTS and (not extra or base.startswith("ours")) and all(_modifier(n) for n in extra)
    except (KeyError, ValueError):
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"{text!r}: expected one of {', '.join(VARIANTS)}, an ours-* one optionally "
                                         f"followed by +{' +'.join(MODIFIERS)} or +budget-B (0 < B < 1)")
    return text


def make_step(spec: Spec, variant: str, device: str, compile_mode: str | None, ids: torch.Tensor, lr: float):
    """(step function, cleanup or None) for one variant (variant_name)."""
    if variant.startswith("hf"):
        return hf_step(spec, device, variant == "hf-compile", compile_mode, ids, lr=lr, liger=variant == "hf-liger")
    options = ours_options(variant)
    return ours_step(spec, device, options.pop("compile"), compile_mode, ids, lr=lr, **options)


def run_variant(name: str, spec: Spec, variant: str, args, flops: float, peak: float | None) -> dict:
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ids = torch.randint(0, hf_config(spec).vocab_size, (spec.batch, spec.seq), device=args.device,
                        generator=torch.Generator(args.device).manual_seed(1))
    step, cleanup = make_step(spec, variant, args.device, args.compile_mode, ids, args.lr)
    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        flush = getattr(step, "flush", None)  # a deferred step: its last update is launched by flush()
        start = time.perf_counter()
        first_loss = float(step())
        if flush is not None:
            first_loss = flush()
        sync()
        first_step_s = time.perf_counter() - start
        for _ in range(args.warmup - 1):
            step()
        if flush is not None:
            flush()
        sync()
        warmup_s = time.perf_counter() - start
        with ClockSampler(uuid=str(torch.cuda.get_device_properties(args.device).uuid)) if cuda \
                else ClockSampler(lib=False) as clocks:  # the SM clock and power over the timed steps
            start = time.perf_counter()
            for _ in range(args.steps):
                loss = step()
            if flush is not None:
                loss = flush()
            sync()
            step_s = (time.perf_counter() - start) / args.steps
    finally:
        if cleanup is not None:
            cleanup()
    tokens_per_s = spec.batch * spec.seq / step_s
    from hf_megatron.kernels import kernels_available
    return {"model": name, "variant": variant, "batch": spec.batch, "seq": spec.seq, "step_s": round(step_s, 4),
            "tokens_per_s": round(tokens_per_s, 1), "mfu": round(tokens_per_s * flops / peak, 4) if peak else None,
            "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
            "first_step_s": round(first_step_s, 2), "warmup_s": round(warmup_s, 2),
            "first_loss": round(first_loss, 4), "loss": round(float(loss), 4),
            # csrc kernels (RMSNorm, SwiGLU, rotary: llama only) ran in ours' eager code -- in ours-compile
            # only the final norm is eager; their first build lands in first_step_s
            "fused_kernels": variant.startswith("ours") and spec.family == "llama" and kernels_available(),
            **clocks.summary()}  # sm_mhz, power_w, power_capped (share of samples at the power cap): with NVML


def free_memory(device: str) -> None:
    torch._dynamo.reset()  # compiled graphs hold their own buffers and cache entries
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def add_ratios(rows: list[dict]) -> None:
    """vs_best_hf: tokens/s over the faster transformers variant of the same model."""
    for row in rows:
        hf = [r["tokens_per_s"] for r in rows if r["model"] == row["model"] and r["variant"].startswith("hf")
              and "error" not in r]
        if "error" not in row and hf:
            row["vs_best_hf"] = round(row["tokens_per_s"] / max(hf), 3)


def markdown(rows: list[dict]) -> str:
    lines = ["| model | variant | tokens/s | MFU | peak mem GiB | first step s | warm-up s | loss | vs best transformers "
             "| SM MHz, W |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['variant']} | error: {r['error']} | | | | | | | |")
            continue
        clocks = f"{r['sm_mhz']}, {r['power_w']}" if "sm_mhz" in r else "-"
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        mem = r["peak_mem_gib"] if r["peak_mem_gib"] is not None else "-"
        ratio = f"{r['vs_best_hf']:.2f}x" if "vs_best_hf" in r else "-"
        lines.append(f"| {r['model']} | {r['variant']} | {r['tokens_per_s']:,.0f} | {mfu} | {mem} | "
                     f"{r['first_step_s']} | {r['warmup_s']} | {r['loss']} | {ratio} | {clocks} |")
    return "\n".join(lines)


def measure_here(name, spec, variant, args, flops, peak) -> dict:
    free_memory(args.device)
    try:
        return run_variant(name, spec, variant, args, flops, peak)
    except Exception as error:  # out of memory, compile failure: a row, not a crash
        return {"model": name, "variant": variant,
                "error": f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200] if str(error).strip() else ''}"}
    finally:
        free_memory(args.device)


def measure_in_child(name, variant, args, peak) -> dict:
    """One (model, variant) in a fresh process: nothing an earlier variant left behind (compiled
    graphs, a patched module, allocator state) reaches its speed or its peak memory."""
    import subprocess
    command = [sys.executable, __file__, "--models", name, "--variants", variant, "--no-isolate", "--child",
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device, "--lr", str(args.lr)]
    command += (["--tiny"] if args.tiny else []) + (["--compile-mode", args.compile_mode] if args.compile_mode else [])
    command += ["--peak", str(peak)] if peak else []
    command += ["--batch", str(args.batch)] if args.batch else []
    done = subprocess.run(command, capture_output=True, text=True)
    rows = [line[len("ROW "):] for line in done.stdout.splitlines() if line.startswith("ROW ")]
    if rows:
        return json.loads(rows[-1])
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
    return {"model": name, "variant": variant, "error": f"child exited {done.returncode}: {tail}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(DEFAULT_MODELS))
    parser.add_argument("--variants", nargs="+", type=variant_name, default=list(VARIANTS),
                        help=f"of {', '.join(VARIANTS)}; an ours-* variant may add +{' +'.join(MODIFIERS)} or "
                             "+budget-B (e.g. ours-compile+deferred+decoder)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10; 1 with --tiny)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps, >= 1 (default 3; 1 with --tiny)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny configs (a CPU dry run)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step for every model given "
                                                                  "(default: each model's own, see above)")
    parser.add_argument("--compile-mode", default=None, help="torch.compile mode for both compiled variants")
    parser.add_argument("--lr", type=float, default=1e-5,
                        help="AdamW lr for both sides (at 1e-5 most bf16 weights stay put for ~10 steps: an update "
                             "below half a bf16 ulp rounds away, so the loss columns lag the fp32-weight anchor)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--no-isolate", dest="isolate", action="store_false",
                        help="run every variant in this process (default: each in a fresh child process)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--peak", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:  # one row for the parent (measure_in_child)
        spec = spec_of(args.models[0], args.tiny, args.batch)
        row = measure_here(args.models[0], spec, args.variants[0], args, flops_per_token(spec), args.peak)
        print("ROW " + json.dumps(row), flush=True)
        return
    args.steps = args.steps or (1 if args.tiny else 10)
    args.warmup = max(1, args.warmup or (1 if args.tiny else 3))
    peak = measure_bf16_peak(device=args.device) if args.device.startswith("cuda") else None
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    record = provenance()
    print(header(record), flush=True)
    print(f"device {device_name}; measured bf16 matmul peak: "
          f"{f'{peak / 1e12:.0f} TFLOP/s' if peak else 'n/a (no CUDA)'}", flush=True)
    rows = []
    for name in args.models:
        spec = spec_of(name, args.tiny, args.batch)
        flops = flops_per_token(spec)
        for variant in args.variants:
            row = measure_in_child(name, variant, args, peak) if args.isolate else measure_here(name, spec, variant,
                                                                                                 args, flops, peak)
            rows.append(row)
            print(json.dumps(row), flush=True)
    add_ratios(rows)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": device_name, "bf16_peak_flops": peak, **record, "rows": rows},
                                              indent=1))
    print(markdown(rows))


if __name__ == "__main__":
    main()

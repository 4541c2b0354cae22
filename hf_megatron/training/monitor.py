"""What `hf-megatron train` shows: console log, progress bar, TensorBoard, loss-curve PNG.

    monitor = Monitor(cfg, run)              # banner (layout, device, arguments), "building model..."
    monitor.model_built(chunks, optimizer)   # parameters (total and per rank), precision, kernels
    monitor.start(iteration, global_batch)   # TensorBoard writer (+ args as text), progress bar
    monitor.step(iteration, stats)           # each iteration; a log line every --log-interval
    monitor.validation(iteration, loss)      # "lm loss validation" (+ ppl)
    monitor.sample(iteration, prompt, text)  # a text sample, console and TensorBoard text
    with monitor.saving(iteration): ...      # "saved checkpoint iteration N (X s)"
    monitor.finish()                         # summary, loss-curve PNG, writer closed

Every rank calls every method (model_built gathers the per-rank parameter counts); only the
logging rank prints and writes: the last pipeline stage's tp 0 / dp 0 rank, which holds the loss
first-hand (Megatron's print_rank_last), i.e. global rank world - world / pp.

Timing: an iteration's time runs from the end of the previous monitor event (step, validation,
sample, save) to the end of its step, so evaluation, sampling and checkpoint writes never count
as training time.  FLOPs, TFLOP/s and MFU: see throughput.py.  TensorBoard tags are
Megatron-LM's where it has one (`lm loss`, `learning-rate`, `grad-norm`, `loss-scale`,
`batch-size`, `iteration-time`, `throughput`, `mem-max-allocated-bytes`, `lm loss validation`,
`lm loss validation ppl`, each loss also `... vs samples`); ours otherwise (`tokens-per-second`,
`mfu`, `skipped-iterations`, `nan-iterations`, text `args` and `sample`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from . import throughput
from .throughput import human, mib


def logging_rank(world: int, pp: int) -> int:
    """Global rank of (pp = last, dp = 0, cp = 0, tp = 0) in the [pp, dp, cp, tp] rank grid."""
    return world - world // pp if pp >= 1 and world % pp == 0 else 0


def ppl(loss: float) -> float:
    return math.exp(min(loss, 50.0))  # exp(50) already says "untrained"; larger overflows nothing useful


def scored(stats: dict) -> bool:
    """The step's global batch held a scored token (an SFT batch of truncated responses holds none)."""
    return stats.get("num_tokens") != 0


def _finite(stats: dict) -> bool:
    return stats.get("loss") is not None and math.isfinite(stats["loss"])


def _skipped(stats: dict) -> bool:
    """No update applied: an fp16 overflow (or a non-finite step without the NaN check)."""
    return bool(stats.get("skipped")) or stats.get("grad_norm") is None


def _fmt_duration(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(round(seconds))))


def logged_lr(stats: dict) -> float | None:
    """The learning rate shown for a step: as Megatron-LM's training_log, the optimizer's lr read after
    the step's scheduler update (`next_lr`: at iteration 1 of a warmup, already the warmup's first
    non-zero lr), else the lr the step used."""
    return stats["next_lr"] if stats.get("next_lr") is not None else stats.get("lr")


def logged_loss_scale(stats: dict) -> float | None:
    """The loss scale shown for a step: as Megatron-LM's training_log, the optimizer's scale read after
    the step (`next_loss_scale`: already halved on the line of a step skipped for an overflow), else
    the scale the step used."""
    return stats["next_loss_scale"] if stats.get("next_loss_scale") is not None else stats.get("loss_scale")


class Monitor:
    def __init__(self, cfg, run, stream=None):
        self.cfg, self.run = cfg, run
        self.stream = stream or sys.stdout
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        self.is_logger = rank == logging_rank(self.world, cfg.pipeline_model_parallel_size)
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() \
            else torch.device("cpu")
        self.writer = self.bar = None
        self.train_curve: list[tuple[int, float]] = []
        self.valid_curve: list[tuple[int, float]] = []
        self.skipped = self.nans = 0
        self.window: list[tuple[float, dict]] = []  # (seconds, stats) since the last log line
        self.step_seconds: list[float] = []
        self.flops_per_iter = self.peak = None
        self.tokens_per_iter = self.global_batch = self.consumed = 0
        self.started = self._mark = time.perf_counter()
        self.banner()

    # ------------------------------------------------------------------ output
    def print(self, line: str) -> None:
        if not self.is_logger:
            return
        if self.bar is not None:
            self.bar.write(line, file=self.stream)  # above the bar, which redraws below
        else:
            print(line, file=self.stream, flush=True)

    def text(self, tag: str, text: str, iteration: int = 0) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, text, iteration)

    def scalars(self, iteration: int, values: dict, samples: int | None = None) -> None:
        if self.writer is None:
            return
        for tag, value in values.items():
            if value is None or not math.isfinite(value):
                continue
            self.writer.add_scalar(tag, value, iteration)
            if samples is not None and "loss" in tag:
                self.writer.add_scalar(f"{tag} vs samples", value, samples)

    # ------------------------------------------------------------------ start
    def layout(self) -> str:
        cfg = self.cfg
        tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
        dp = self.world // (tp * pp) if self.world % (tp * pp) == 0 else "?"
        return (f"tp={tp} pp={pp} dp={dp} vpp={cfg.virtual_pipeline_model_parallel_size or 1} "
                f"sp={'on' if cfg.sequence_parallel else 'off'}")

    def precision(self) -> str:
        cfg = self.cfg
        if cfg.fp16:
            scaling = f"static loss scale {cfg.loss_scale:g}" if cfg.loss_scale else \
                f"dynamic loss scale from {cfg.initial_loss_scale:g}"
            return f"fp16 ({scaling}, fp32 main weights)"
        static = f", static loss scale {cfg.loss_scale:g}" if cfg.loss_scale is not None else ""
        if cfg.bf16:
            return f"bf16 (fp32 main weights{static})"
        return f"fp32 (static loss scale {cfg.loss_scale:g})" if static and cfg.use_distributed_optimizer else "fp32"

    def banner(self) -> None:
        """First output, before anything slow: layout, device, precision, every argument."""
        if self.device.type == "cuda":
            where = f"{torch.cuda.get_device_name(self.device)} (cuda, nccl)"
        else:
            where = "cpu (gloo)" if self.world > 1 else "cpu"
        self.print(f"hf-megatron train: {self.world} process{'es' if self.world > 1 else ''} | {self.layout()} | "
                   f"{self.precision()} | {where}")
        self.print("------------------------ arguments ------------------------")
        for name, value in sorted(self.arguments().items()):
            self.print(f"  {name} {'.' * max(48 - len(name), 2)} {value}")
        self.print("-------------------- end of arguments ---------------------")
        self.print("building model ...")

    def arguments(self) -> dict:
        """Every argument, as Megatron-LM prints them; the model-shape flags only when the model is built
        from them (with --hf-config / --hf-model / --load their defaults describe nothing that runs)."""
        from .model_flags import ModelFlags
        shape = set() if self.run.model_flags_given() else {f.name for f in dataclasses.fields(ModelFlags)}
        if self.run.null_tokenizer_vocab_size():
            shape.discard("vocab_size")  # the NullTokenizer's size
        return {f.name: getattr(c, f.name) for c in (self.cfg, self.run) for f in dataclasses.fields(c)
                if f.name not in shape}

    def kernels(self, config) -> str:
        from ..kernels import enabled, kernels_available
        ops = [op for op, used in (("rms_norm", config.normalization == "RMSNorm"),
                                   ("swiglu", config.activation == "swiglu"),
                                   ("rotary", config.position_embedding_type == "rope")) if used]
        if not ops:
            return "none of the fused ops apply to this model"
        if self.device.type != "cuda":
            why = "CPU"
        elif not enabled():
            why = "HF_MEGATRON_KERNELS=0"
        elif kernels_available():
            return f"csrc CUDA {', '.join(ops)}"
        else:
            why = "the csrc extension did not build, see the warning above"
        return f"PyTorch fallbacks for {', '.join(ops)} ({why})"

    def model_built(self, chunks, optimizer=None) -> None:
        """Parameters total / per (tp, pp) rank, kernels, optimizer, MFU peak.  Collective."""
        from ..model.gpt import GPTModel
        from ..parallel import state
        gpt = getattr(chunks[0], "module", chunks[0])
        config = gpt.config
        with torch.device("meta"):
            whole = GPTModel(config)
        total = sum(p.numel() for p in whole.parameters())
        self.n_matmul = throughput.matmul_params(whole)
        mine = sum(p.numel() for c in chunks for p in c.parameters())
        grid = state.get_state()
        entry = (grid.coords["tp"], grid.coords["pp"], grid.coords["dp"], mine)
        entries = [entry]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            entries = [None] * dist.get_world_size()
            dist.all_gather_object(entries, entry)
        per_rank = ", ".join(f"(tp {t}, pp {p}) {human(n)}" for t, p, d, n in sorted(entries, key=lambda e: e[1::-1])
                             if d == 0)
        self.print(f"model built in {time.perf_counter() - self.started:.1f} s: {config.num_layers} layers, hidden "
                   f"{config.hidden_size}, heads {config.num_attention_heads}/{config.num_query_groups}, vocab "
                   f"{config.vocab_size} (padded {config.padded_vocab_size(self.cfg.tensor_model_parallel_size)})")
        self.print(f"parameters: {human(total)} total ({total:,}; {human(self.n_matmul)} in matmuls); per rank: {per_rank}")
        self.peak, gpu = throughput.peak_tflops(self.device, self.cfg.params_dtype)
        if self.run.peak_tflops:
            self.peak, gpu = self.run.peak_tflops, f"{gpu}, --peak-tflops"
        peak = f"{self.peak:g} TFLOP/s per GPU ({gpu})" if self.peak else \
            ("none on CPU: MFU not shown" if gpu == "cpu" else f"unknown for {gpu}: give --peak-tflops for MFU")
        inner = getattr(optimizer, "optimizer", optimizer)
        opt = f"{type(inner).__module__.split('.')[0]} {type(inner).__name__}" if inner is not None else "none"
        self.print(f"precision: {self.precision()} | kernels: {self.kernels(config)} | optimizer: {opt} | peak: {peak}")
        self.config = config

    def start(self, iteration: int, global_batch: int) -> None:
        """Before the first step (after any --load): writer, progress bar, the run's constants."""
        self.first_iteration = iteration
        self.global_batch = global_batch
        self.tokens_per_iter = global_batch * self.run.seq_length
        self.flops_per_iter = throughput.flops_per_iteration(self.config, self.n_matmul, self.tokens_per_iter,
                                                             self.run.seq_length)
        if self.is_logger and self.run.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(self.run.tensorboard_dir)
            rows = "\n".join(f"| {k} | {v} |" for k, v in sorted(self.arguments().items()))
            self.text("args", f"| argument | value |\n| --- | --- |\n{rows}")
            self.text("layout", f"{self.layout()}, {self.precision()}, {self.world} processes")
        if self.is_logger and not self.run.no_progress_bar and self.stream.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=self.cfg.train_iters, initial=iteration, unit="it", dynamic_ncols=True,
                            file=self.stream, leave=False)
        self.print(f"training from iteration {iteration} to {self.cfg.train_iters}: global batch {global_batch}, "
                   f"{self.tokens_per_iter:,} tokens, {human(self.flops_per_iter)}FLOP per iteration")
        self._mark = time.perf_counter()

    # ------------------------------------------------------------------ loop
    def _elapsed(self) -> float:
        now = time.perf_counter()
        seconds, self._mark = now - self._mark, now
        return seconds

    def step(self, iteration: int, stats: dict) -> None:
        seconds = self._elapsed()
        loss, grad_norm = stats.get("loss"), stats.get("grad_norm")
        finite = _finite(stats)
        shown = finite and scored(stats)  # a batch with no scored token: its loss 0 measures nothing (no NaN)
        self.skipped += _skipped(stats)
        self.nans += not finite
        # another part of the loop may count them itself (e.g. across a resume): take the larger
        self.skipped = max(self.skipped, int(stats.get("skipped_iterations") or 0))
        self.nans = max(self.nans, int(stats.get("nan_iterations") or 0))
        self.step_seconds.append(seconds)
        self.window.append((seconds, stats))
        samples = stats.get("consumed_samples") or iteration * self.global_batch  # the loop's count when it keeps one
        self.consumed = samples
        if shown:
            self.train_curve.append((iteration, loss))
        self.scalars(iteration, {"lm loss": loss if shown else None, "learning-rate": logged_lr(stats),
                                 "grad-norm": grad_norm, "loss-scale": logged_loss_scale(stats),
                                 "batch-size": self.global_batch, "skipped-iterations": self.skipped,
                                 "nan-iterations": self.nans}, samples)
        if self.bar is not None:
            self.bar.update(1)
            if shown:
                self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        if iteration % self.run.log_interval == 0 or iteration == self.cfg.train_iters:
            self.log_line(iteration)

    def rates(self, seconds_per_iter: float) -> dict:
        tflops = self.flops_per_iter / (seconds_per_iter * max(self.world, 1)) / 1e12
        return {"tokens_per_s": self.tokens_per_iter / seconds_per_iter, "tflops": tflops,
                "mfu": tflops / self.peak if self.peak else None}

    def log_line(self, iteration: int) -> None:
        seconds = sum(s for s, _ in self.window) / len(self.window)
        rates = self.rates(max(seconds, 1e-9))
        last = self.window[-1][1]
        losses = [s["loss"] for _, s in self.window if not _skipped(s) and _finite(s) and scored(s)]
        loss = sum(losses) / len(losses) if losses else last.get("loss") if scored(last) else None
        memory, what = throughput.peak_memory_bytes(self.device)
        measured = self.step_seconds[1:] or self.step_seconds  # the first step also warms up
        eta = max(self.cfg.train_iters - iteration, 0) * sum(measured) / len(measured)
        grad = f"{last['grad_norm']:.3f}" if last.get("grad_norm") is not None else "skipped"
        parts = [f" iteration {iteration:6d}/{self.cfg.train_iters}",
                 f"consumed samples: {self.consumed}",
                 f"elapsed time per iteration (ms): {seconds * 1000:.1f}",
                 f"throughput per GPU (TFLOP/s/GPU): {rates['tflops']:.3g}"]
        if rates["mfu"] is not None:
            parts.append(f"MFU: {100 * rates['mfu']:.1f}%")
        parts += [f"tokens/s: {rates['tokens_per_s']:,.0f}", f"learning rate: {logged_lr(last) or 0.0:.6E}",
                  f"lm loss: {loss:.6E}" if loss is not None else "lm loss: n/a",
                  f"loss scale: {logged_loss_scale(last) or 1.0:g}", f"grad norm: {grad}",
                  # in this log interval, as Megatron-LM's training_log (it resets them after each line)
                  f"number of skipped iterations: {sum(_skipped(s) for _, s in self.window)}",
                  f"number of nan iterations: {sum(not _finite(s) for _, s in self.window)}",
                  f"peak memory ({what}): {mib(memory)}", f"ETA: {_fmt_duration(eta)}"]
        self.print(" | ".join(parts))
        self.scalars(iteration, {"iteration-time": seconds, "throughput": rates["tflops"],
                                 "tokens-per-second": rates["tokens_per_s"], "mfu": rates["mfu"],
                                 ("mem-max-allocated-bytes" if self.device.type == "cuda" else "mem-max-rss-bytes"):
                                     float(memory)})
        self.window = []

    def validation(self, iteration: int, loss: float) -> None:
        seconds = self._elapsed()
        self.valid_curve.append((iteration, loss))
        self.print(f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} | "
                   f"lm loss PPL: {ppl(loss):.6E} | ({seconds:.1f} s)")
        self.scalars(iteration, {"lm loss validation": loss, "lm loss validation ppl": ppl(loss)},
                     self.consumed or iteration * self.global_batch)

    def sample(self, iteration: int, prompt: str, continuation: str) -> None:
        seconds = self._elapsed()
        self.print(f" sample at iteration {iteration} ({seconds:.1f} s): {prompt!r} -> {continuation!r}")
        self.text("sample", f"**{prompt}**{continuation}", iteration)

    def warn(self, line: str) -> None:
        """One line on stderr from the logging rank: the run goes on, but not as the flags may suggest."""
        if self.is_logger:
            print(f"hf-megatron train: warning: {line}", file=sys.stderr, flush=True)

    def note(self, line: str) -> None:
        """A one-off line (e.g. why text samples are skipped); not counted as training time."""
        self.print(line)
        self._mark = time.perf_counter()

    @contextlib.contextmanager
    def saving(self, iteration: int):
        begin = time.perf_counter()
        yield
        self.print(f" saved checkpoint iteration {iteration} ({time.perf_counter() - begin:.1f} s)")
        self._mark = time.perf_counter()

    # ------------------------------------------------------------------ end
    def finish(self) -> str | None:
        """Summary lines, the loss-curve PNG (its path is returned), the writer flushed and closed."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        done = len(self.step_seconds)
        wall = time.perf_counter() - self.started
        if done:
            seconds = sum(self.step_seconds) / done
            rates = self.rates(seconds)
            curve = f"{self.train_curve[0][1]:.4f} -> {self.train_curve[-1][1]:.4f}" if self.train_curve else "n/a"
            memory, what = throughput.peak_memory_bytes(self.device)
            mfu = f", MFU {100 * rates['mfu']:.1f}%" if rates["mfu"] is not None else ""
            self.print(f"training done: {done} iterations in {_fmt_duration(wall)} ({seconds * 1000:.1f} ms/iteration, "
                       f"{rates['tokens_per_s']:,.0f} tokens/s, {rates['tflops']:.3g} TFLOP/s/GPU{mfu}) | lm loss "
                       f"{curve} | skipped {self.skipped}, nan {self.nans} | "
                       f"peak memory ({what}) {mib(memory)}")
        if self.valid_curve:
            best_at, best = min(self.valid_curve, key=lambda p: p[1])
            self.print(f"validation: last {self.valid_curve[-1][1]:.4f} (ppl {ppl(self.valid_curve[-1][1]):.2f}), "
                       f"best {best:.4f} at iteration {best_at}")
        path = self.plot() if self.is_logger else None
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        return path

    def plot(self) -> str | None:
        folder = self.run.tensorboard_dir or self.run.save
        if not self.train_curve:
            return None
        if not folder:
            self.print("loss curve: skipped (no --tensorboard-dir or --save folder to put it in)")
            return None
        try:
            from .plot import write_loss_curve
        except ImportError as exc:
            self.print(f"loss curve: skipped ({(exc.name or 'matplotlib').split('.')[0]} is not installed)")
            return None
        path = write_loss_curve(os.path.join(folder, "loss_curve.png"), self.train_curve, self.valid_curve)
        self.print(f"loss curve: {path}")
        return path

"""What `hf-megatron train` shows, read back as a user would: the console log (banner, log-line
fields, saved-checkpoint lines, summary), the TensorBoard events (EventAccumulator: Megatron-LM's
scalar tags, the args and the text samples), the loss-curve PNG; the text sample equals
transformers' own greedy continuation from the converted final weights; the FLOPs behind
TFLOP/s / MFU equal torch's FlopCounterMode on the transformers model."""
import io
import math
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_megatron.data import IndexedDatasetWriter
from tiny import VOCAB, tiny_config, tiny_hf_model

PROMPT = "def __init__(self"
ITERS, LOG, EVAL, GBS, SEQ = 8, 4, 4, 4, 32
SCALARS = {"lm loss", "lm loss vs samples", "learning-rate", "grad-norm", "loss-scale", "batch-size",
           "iteration-time", "throughput", "tokens-per-second", "mem-max-rss-bytes", "skipped-iterations",
           "nan-iterations", "lm loss validation", "lm loss validation ppl", "lm loss validation vs samples"}


def make_corpus(root: Path, docs: int = 120) -> Path:
    """A byte-level BPE (vocab <= the tiny models' 300) and its tokens of some stdlib sources as
    an indexed dataset; returns the tokenizer folder."""
    from transformers import AutoTokenizer

    from hf_megatron.data.tokenizers import train_bpe_tokenizer
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(encoding="utf-8", errors="ignore")[:2500] for p in sorted(stdlib.glob("*.py"))[:docs]]
    train_bpe_tokenizer(texts, VOCAB, str(root / "tok"))
    tokenizer = AutoTokenizer.from_pretrained(root / "tok")
    assert len(tokenizer) <= VOCAB
    with IndexedDatasetWriter(str(root / "corpus_text_document"), dtype=np.uint16) as writer:
        for ids in tokenizer(texts).input_ids:
            writer.add_item(np.array(ids + [tokenizer.eos_token_id]))
            writer.end_document()
    return root / "tok"


def train_cli(root: Path, *extra, env=None):
    cmd = [sys.executable, "-m", "hf_megatron.cli", "train", "--hf-config", root / "config",
           "--data-path", root / "corpus_text_document", "--split", "90,10,0", "--seq-length", SEQ,
           "--micro-batch-size", 2, "--global-batch-size", GBS, "--train-iters", ITERS, "--lr", 3e-3,
           "--log-interval", LOG, *extra]
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("monitor")
    make_corpus(root)
    tiny_config("llama").save_pretrained(root / "config")
    result = train_cli(root, "--eval-interval", EVAL, "--eval-iters", 2, "--save", root / "ckpt",
                       "--tensorboard-dir", root / "tb", "--tokenizer-model", root / "tok",
                       "--sample-prompt", PROMPT, "--sample-tokens", 10)
    assert result.returncode == 0, result.stderr[-3000:]
    return root, result.stdout


@pytest.fixture(scope="module")
def events(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run[0] / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _texts(events, tag):
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors(f"{tag}/text_summary")]


def _fields(line: str) -> dict[str, str]:
    return dict(part.strip().split(": ", 1) for part in line.split("|")[1:] if ": " in part)


def test_log_shows_banner_fields_saves_and_summary(run):
    root, out = run
    lines = out.splitlines()
    assert lines[0].startswith("hf-megatron train: 1 process | tp=1 pp=1 dp=1 vpp=1 sp=off | fp32 | cpu")
    assert lines.index("building model ...") < next(i for i, x in enumerate(lines) if x.startswith("model built"))
    assert any(re.match(r"  sample_prompt \.+ def __init__\(self$", x) for x in lines)  # every argument
    # the model comes from --hf-config: the model-shape flags' defaults (LayerNorm, learned positions) are not shown
    assert not any(re.match(r"  (normalization|position_embedding_type|swiglu) \.+", x) for x in lines)
    hf = tiny_hf_model("llama")  # parameters: transformers' count plus Megatron's vocab padding (untied: x2)
    config = hf.config
    padded = -(-config.vocab_size // 128) * 128
    total = sum(p.numel() for p in hf.parameters()) + 2 * (padded - config.vocab_size) * config.hidden_size
    assert f"total ({total:,};" in out and "per rank: (tp 0, pp 0)" in out
    assert "kernels: PyTorch fallbacks for rms_norm, swiglu, rotary (CPU)" in out

    logged = [x for x in lines if x.startswith(" iteration")]
    assert [int(re.match(r" iteration +(\d+)/", x).group(1)) for x in logged] == [4, 8]
    fields = _fields(logged[0])
    for key in ("consumed samples", "elapsed time per iteration (ms)", "throughput per GPU (TFLOP/s/GPU)",
                "tokens/s", "learning rate", "lm loss", "loss scale", "grad norm", "number of skipped iterations",
                "number of nan iterations", "peak memory (peak RSS)", "ETA"):
        assert key in fields, (key, logged[0])
    assert "MFU" not in logged[0]  # no known peak on a CPU
    assert fields["consumed samples"] == str(LOG * GBS)
    assert fields["number of skipped iterations"] == fields["number of nan iterations"] == "0"
    assert float(fields["elapsed time per iteration (ms)"]) > 0 and float(fields["grad norm"]) > 0
    assert re.fullmatch(r"\d+:\d\d:\d\d", fields["ETA"]) and fields["peak memory (peak RSS)"].endswith("MiB")
    assert re.search(rf"^ saved checkpoint iteration {ITERS} \(\d+\.\d s\)$", out, re.M)
    assert re.search(rf"^training done: {ITERS} iterations in ", out, re.M)
    assert len(re.findall(r"^ validation loss at iteration \d+ \| lm loss value: ", out, re.M)) == ITERS // EVAL


def test_tensorboard_holds_megatron_tags_args_and_samples(run, events):
    root, out = run
    assert SCALARS <= set(events.Tags()["scalars"]), SCALARS - set(events.Tags()["scalars"])
    loss = events.Scalars("lm loss")
    assert [e.step for e in loss] == list(range(1, ITERS + 1))
    # the log line's lm loss is the mean over its interval of the per-iteration values
    first_line = _fields(next(x for x in out.splitlines() if x.startswith(" iteration")))
    assert float(first_line["lm loss"]) == pytest.approx(np.mean([e.value for e in loss[:LOG]]), rel=1e-5)
    assert float(first_line["learning rate"]) == pytest.approx(events.Scalars("learning-rate")[LOG - 1].value, rel=1e-5)
    valid = events.Scalars("lm loss validation")
    assert [e.step for e in valid] == [EVAL, 2 * EVAL]
    for v, p in zip(valid, events.Scalars("lm loss validation ppl")):
        assert p.value == pytest.approx(math.exp(v.value), rel=1e-5)
    assert [e.value for e in events.Scalars("batch-size")] == [GBS] * ITERS

    (_, args), = _texts(events, "args")
    assert "| lr | 0.003 |" in args and f"| sample_prompt | {PROMPT} |" in args
    samples = _texts(events, "sample")
    assert [step for step, _ in samples] == [EVAL, 2 * EVAL]
    for step, text in samples:
        assert text.startswith(f"**{PROMPT}**")
        assert f" sample at iteration {step} " in out


def test_sample_is_transformers_greedy_continuation(run, events, tmp_path):
    """The iteration-8 sample = transformers' greedy continuation with the final weights (the
    checkpoint written right after it), converted to an HF folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_megatron.conversion.convert import megatron_to_hf
    root, _ = run
    megatron_to_hf(root / "ckpt", tmp_path / "hf", tokenizer=root / "tok")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokenizer = AutoTokenizer.from_pretrained(root / "tok")
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        for _ in range(10):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    expected = tokenizer.decode(ids[0, len(tokenizer(PROMPT).input_ids):])
    step, text = _texts(events, "sample")[-1]
    assert step == ITERS and text == f"**{PROMPT}**{expected}"


def test_loss_curve_png_is_a_valid_image(run):
    root, out = run
    path = root / "tb" / "loss_curve.png"
    assert f"loss curve: {path}" in out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size[0] > 100 and image.size[1] > 100
    import matplotlib.image
    pixels = matplotlib.image.imread(str(path))
    assert pixels.ndim == 3 and pixels.std() > 0  # drawn, not blank


def _monitor(tmp_path, **run_fields):
    from hf_megatron.training.config import RunConfig, TrainingConfig
    from hf_megatron.training.monitor import Monitor
    run = RunConfig(hf_config=str(tmp_path), data_path=["x"], **run_fields)
    return Monitor(TrainingConfig(train_iters=3), run, stream=io.StringIO())


def test_loss_curve_goes_to_save_without_tensorboard_and_is_skipped_without_matplotlib(tmp_path, monkeypatch):
    monitor = _monitor(tmp_path, save=str(tmp_path / "ckpt"))
    monitor.train_curve, monitor.valid_curve = [(1, 3.0), (2, 2.5), (3, 2.0)], [(3, 2.2)]
    assert monitor.plot() == str(tmp_path / "ckpt" / "loss_curve.png")
    assert (tmp_path / "ckpt" / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    mask = os.umask(0o022)  # the mode open() gives under the umask, as the checkpoint files (was mkstemp's 0600)
    try:
        monitor.plot()
    finally:
        os.umask(mask)
    assert (tmp_path / "ckpt" / "loss_curve.png").stat().st_mode & 0o777 == 0o644
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["loss_curve.png"]
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    monkeypatch.delitem(sys.modules, "hf_megatron.training.plot", raising=False)
    monitor = _monitor(tmp_path, save=str(tmp_path / "other"))
    monitor.train_curve = [(1, 3.0)]
    assert monitor.plot() is None and not (tmp_path / "other").exists()
    assert "loss curve: skipped (matplotlib is not installed)" in monitor.stream.getvalue()


def test_samples_are_skipped_with_a_reason_without_a_tokenizer(tmp_path):
    from hf_megatron.errors import DataError
    from hf_megatron.training.config import RunConfig
    from hf_megatron.training.sampling import sampler_for_run
    tiny_config("llama").save_pretrained(tmp_path / "config")  # a config folder without tokenizer files
    run = RunConfig(hf_config=str(tmp_path / "config"), data_path=["x"], sample_prompt="hello")
    sampler, why = sampler_for_run(run, seed=0)
    assert sampler is None and why.startswith("text samples skipped: no tokenizer (give --tokenizer-model")
    with pytest.raises(DataError, match="nowhere: cannot load a tokenizer"):
        sampler_for_run(RunConfig(hf_config=str(tmp_path / "config"), data_path=["x"], sample_prompt="hi",
                                  tokenizer_model=str(tmp_path / "nowhere")), seed=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_model_flops_equal_torch_flop_counter_on_transformers(arch):
    """F = 6 N_matmul T + 12 L a s T (throughput.py) against FlopCounterMode over transformers'
    forward + backward (eager attention, whose two bmm products the counter sees; vocab 256 so
    Megatron's padding adds nothing)."""
    from torch.utils.flop_counter import FlopCounterMode

    from hf_megatron.config import ModelConfig
    from hf_megatron.model.gpt import GPTModel
    from hf_megatron.training.throughput import flops_per_iteration, matmul_params
    hf = tiny_hf_model(arch, vocab_size=256)
    hf.set_attn_implementation("eager")
    batch, seq = 2, 16
    ids = torch.randint(0, 256, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        hf(ids, labels=ids).loss.backward()
    config = ModelConfig.from_hf(hf.config)
    with torch.device("meta"):
        whole = GPTModel(config)
    assert flops_per_iteration(config, matmul_params(whole), batch * seq, seq) == counter.get_total_flops()


def test_peak_lookup_by_gpu_name():
    from hf_megatron.training.throughput import peak_for_gpu
    bf16, fp32 = torch.bfloat16, torch.float32
    assert peak_for_gpu("NVIDIA H100 80GB HBM3", bf16) == 989.0
    assert peak_for_gpu("NVIDIA H100 PCIe", bf16) == 756.0  # the longer name wins
    assert peak_for_gpu("NVIDIA A10", bf16) == 125.0 and peak_for_gpu("NVIDIA A100-SXM4-80GB", bf16) == 312.0
    assert peak_for_gpu("NVIDIA A100-SXM4-80GB", fp32) == 19.5
    assert peak_for_gpu("NVIDIA A100-SXM4-80GB", fp32, tf32=True) == 156.0
    assert peak_for_gpu("Tesla T4", bf16) is None



def test_log_counts_skipped_and_nan_steps_and_survives_a_none_grad_norm(tmp_path):
    """fp16 overflow steps come with grad_norm None; the loop may also pass its own running totals."""
    from hf_megatron.config import ModelConfig
    from hf_megatron.loading import build_model
    from hf_megatron.parallel import state
    state.reset()
    monitor = _monitor(tmp_path, log_interval=3)
    monitor.model_built([build_model(ModelConfig.from_hf(tiny_config("llama")))])
    monitor.start(0, GBS)
    steps = [{"loss": 5.0, "grad_norm": None, "skipped": True, "lr": 1e-3, "loss_scale": 2.0 ** 32},
             {"loss": float("nan"), "grad_norm": None, "skipped": True, "lr": 1e-3, "loss_scale": 2.0 ** 31},
             {"loss": 4.0, "grad_norm": 1.0, "skipped": False, "lr": 1e-3, "loss_scale": 2.0 ** 30,
              "skipped_iterations": 2, "nan_iterations": 1},
             {"loss": 3.0, "grad_norm": None, "skipped": True, "lr": 1e-3, "loss_scale": 2.0 ** 29,
              "skipped_iterations": 5, "nan_iterations": 1, "consumed_samples": 99}]  # totals of a resumed run
    for iteration, stats in enumerate(steps[:3], start=1):
        monitor.step(iteration, stats)
    line = _fields(monitor.stream.getvalue().splitlines()[-1])
    assert line["lm loss"] == "4.000000E+00"  # the mean over applied steps only
    assert (line["grad norm"], line["number of skipped iterations"], line["number of nan iterations"]) == ("1.000", "2", "1")
    assert line["consumed samples"] == str(3 * GBS) and line["loss scale"] == f"{2.0 ** 30:g}"
    # a step's stats with the scaler's value after it: the line shows that one, as Megatron-LM's
    monitor.step(3, {**steps[2], "next_loss_scale": 2.0 ** 31})
    assert _fields(monitor.stream.getvalue().splitlines()[-1])["loss scale"] == f"{2.0 ** 31:g}"
    monitor.step(4, steps[3])
    monitor.log_line(4)
    line = _fields(monitor.stream.getvalue().splitlines()[-1])
    # the log line counts this interval's (Megatron-LM's training_log); the summary, the run's
    assert (line["grad norm"], line["number of skipped iterations"], line["consumed samples"]) == ("skipped", "1", "99")
    assert line["lm loss"] == "3.000000E+00"  # nothing applied in the window: the last loss
    monitor.finish()

"""Model FLOPs, TFLOP/s and MFU per GPU, and peak memory: the arithmetic behind the training log.

Model FLOPs of one iteration (the Megatron-LM / PaLM convention: recomputation not counted):

    F = 6 * N_matmul * T  +  12 * L * (heads * head_dim) * s * T

    N_matmul  weights that take part in a matrix multiply: every layer's linear_qkv, linear_proj,
              linear_fc1, linear_fc2 and the output layer (vocab_padded x hidden, also when tied);
              embedding look-ups, norms and biases are not multiplies
    T         tokens per iteration = global batch size * seq_length
    L, s      layers, sequence length;  heads * head_dim is the attention width (= hidden for most models)
    6 = 2 (a multiply-add is 2 FLOPs) * 3 (forward, and backward twice as much);  12 * L * a * s per
    token = 3 * the two attention products Q K^T and P V (2 * 2 * s * a each layer, causal mask ignored)

    TFLOP/s per GPU = F / (seconds per iteration * world size) / 1e12
    MFU             = TFLOP/s per GPU / peak TFLOP/s of the GPU at the run's precision

Peaks are dense (no sparsity) datasheet numbers, looked up by `torch.cuda.get_device_name()`;
`--peak-tflops` overrides them.  Where no peak is known (an unlisted GPU, or the CPU), MFU is left
out rather than guessed.
"""
from __future__ import annotations

import re
import resource
import sys

import torch

# GPU name (a whole word of the device name) -> (bf16/fp16 tensor-core, fp32) dense TFLOP/s
PEAK_TFLOPS: dict[str, tuple[float, float | None]] = {
    "GB200": (2500.0, None), "B200": (2250.0, None), "H200": (989.0, 67.0), "GH200": (989.0, 67.0),
    "H100 PCIe": (756.0, 51.0), "H100 NVL": (835.0, 60.0), "H100": (989.0, 67.0), "H800": (989.0, 67.0),
    "A100": (312.0, 19.5), "A800": (312.0, 19.5), "A10G": (70.0, 31.2), "A10": (125.0, 31.2),
    "L40S": (362.0, 91.6), "L40": (181.0, 90.5), "L4": (121.0, 30.3), "V100": (125.0, 15.7),
    "RTX 4090": (165.0, 82.6), "RTX 3090": (71.0, 35.6), "MI300X": (1307.0, 163.4), "MI250X": (383.0, 95.7),
}


def matmul_params(model) -> int:
    """N_matmul of a whole (unsplit, unsharded) GPTModel, e.g. one built on the meta device."""
    config = model.config
    count = sum(p.numel() for name, p in model.decoder.layers.named_parameters()
                if p.dim() == 2 and "layernorm" not in name)
    return count + config.padded_vocab_size() * config.hidden_size  # the logits matmul, tied or not


def flops_per_iteration(config, n_matmul: int, tokens: int, seq_length: int) -> float:
    """F above, for `tokens` tokens per iteration."""
    attention_width = config.num_attention_heads * config.kv_channels
    return 6.0 * n_matmul * tokens + 12.0 * config.num_layers * attention_width * seq_length * tokens


def peak_for_gpu(name: str, dtype: torch.dtype, tf32: bool = False) -> float | None:
    """Datasheet peak TFLOP/s of the GPU called `name` at `dtype` (TF32 tensor cores: half the
    bf16 rate), None when the name is not in the table."""
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):  # "H100 PCIe" before "H100", "A10G" before "A10"
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", name):
            tensor, fp32 = PEAK_TFLOPS[key]
            if dtype in (torch.bfloat16, torch.float16):
                return tensor
            return tensor / 2 if tf32 else fp32
    return None


def peak_tflops(device: torch.device, dtype: torch.dtype) -> tuple[float | None, str]:
    """(peak TFLOP/s of this device at `dtype` or None, the device's name)."""
    if device.type != "cuda":
        return None, "cpu"
    name = torch.cuda.get_device_name(device)
    return peak_for_gpu(name, dtype, tf32=torch.backends.cuda.matmul.allow_tf32), name


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """(bytes, what) : CUDA max_memory_allocated on a GPU, else the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "max allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (rss if sys.platform == "darwin" else rss * 1024), "peak RSS"  # Linux reports KiB, macOS bytes


def human(n: float, unit: str = "") -> str:
    """1234567 -> '1.23M' (decimal prefixes)."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{prefix}{unit}"
    return f"{n:.0f}{unit}"


def mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"

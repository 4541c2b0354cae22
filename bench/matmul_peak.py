"""Measured bf16 matmul peak of this GPU (8192^3 products on random data, median of CUDA-event timings)."""
import json
import sys

import torch


def measure_bf16_peak(n: int = 8192, device: str = "cuda") -> float:
    """FLOP/s of an n x n x n bf16 matmul on the current CUDA device (median of 10 after 3 warm-ups)."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n ** 3 / sorted(times)[len(times) // 2]


def main() -> None:
    json.dump({"bf16_matmul_flops": measure_bf16_peak()}, sys.stdout)
    print()


if __name__ == "__main__":
    main()

"""Measured bf16 matmul peak of this GPU (8192^3 products on random data, median of CUDA-event timings)."""
import json
import sys

import torch


def main() -> None:
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
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
    peak = 2 * n ** 3 / sorted(times)[len(times) // 2]
    json.dump({"bf16_matmul_flops": peak}, sys.stdout)
    print()


if __name__ == "__main__":
    main()

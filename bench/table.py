"""Markdown table of bench_parallel.py results (first file = the anchor for ratios)."""
import json
import sys
from pathlib import Path


def main() -> None:
    rows = [json.loads(Path(p).read_text()) for p in sys.argv[1:] if Path(p).is_file()]
    if not rows:
        print("no results")
        return
    singles = {r["global_batch"]: r for r in rows if r["gpus"] == 1 and not r["layout"].startswith("transformers")}
    anchor = rows[0]
    print("| layout | GPUs | global batch | tokens/s | tokens/s/GPU | TFLOP/s/GPU | MFU (measured peak) | MFU (989 TF) | vs transformers/GPU | vs N x our 1-GPU | max mem GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        vs_anchor = r["tokens_per_s_per_gpu"] / anchor["tokens_per_s_per_gpu"]
        single = singles.get(r["global_batch"])  # scaling against our 1-GPU run at the same global batch
        scaling = r["tokens_per_s"] / (r["gpus"] * single["tokens_per_s"]) if single else float("nan")
        extras = " ".join(k for k in ("sp", "dist_opt", "fused_kernels") if r.get(k))
        print(f"| {r['layout']} {extras} | {r['gpus']} | {r['global_batch']} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s_per_gpu']:,.0f} | "
              f"{r['tflops_per_gpu']} | {r['mfu_measured_peak']:.1%} | {r['mfu_datasheet']:.1%} | {vs_anchor:.2f}x | "
              f"{scaling:.2f} | {r['max_mem_gib']} |")


if __name__ == "__main__":
    main()

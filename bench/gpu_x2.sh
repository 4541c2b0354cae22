#!/usr/bin/env bash
# The GPU session on nvidia-h200-x2 (run from the repo root by the device tool):
#   kernels check + bench, NCCL bf16 parity of 2-GPU layouts vs 1 GPU, throughput table.
# MODE=smoke runs a tiny model only (to catch errors cheaply).
set -u
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1
O=/tmp/gpu_results; mkdir -p "$O"  # copied to $OUT at the end (the tool returns at most 8 files)
MODE=${MODE:-full}; MODEL=${MODEL:-3b}; SEQ=${SEQ:-4096}; GBS=${GBS:-8}
T="python3 -m torch.distributed.run --standalone"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'gpus', torch.cuda.device_count())"

if [ -f bench/gpu_check.sh ] && [ "${KERNELS:-1}" = 1 ]; then
  echo "== kernels"; bash bench/gpu_check.sh > "$O/kernels.log" 2>&1; echo "kernels exit $?"; tail -25 "$O/kernels.log"
fi

if [ "${PARITY:-1}" = 1 ]; then
echo "== parity (bf16, NCCL)"
$T --nproc-per-node 1 bench/gpu_parity.py --out "$O/p0_ref.json" > "$O/parity.log" 2>&1
$T --nproc-per-node 2 bench/gpu_parity.py --tp 2 --sp --out "$O/p1_tp2.json" >> "$O/parity.log" 2>&1
$T --nproc-per-node 2 bench/gpu_parity.py --pp 2 --out "$O/p2_pp2.json" >> "$O/parity.log" 2>&1
$T --nproc-per-node 2 bench/gpu_parity.py --dist-opt --out "$O/p3_dp2.json" >> "$O/parity.log" 2>&1
$T --nproc-per-node 2 bench/gpu_parity.py --pp 2 --vpp 2 --out "$O/p4_vpp.json" >> "$O/parity.log" 2>&1
python3 bench/gpu_parity.py --compare "$O"/p0_ref.json "$O"/p1_tp2.json "$O"/p2_pp2.json "$O"/p3_dp2.json "$O"/p4_vpp.json | tee "$O/parity.txt"
grep -m3 -B2 -A12 "Traceback" "$O/parity.log" | head -60
fi

if [ "${THROUGHPUT:-1}" = 1 ]; then
[ "$MODE" = smoke ] && { MODEL=tiny; SEQ=512; }
echo "== throughput ($MODEL, seq $SEQ, global batch $GBS)"
PEAK=$(python3 bench/matmul_peak.py | python3 -c "import json,sys; print(json.load(sys.stdin)['bf16_matmul_flops'])")
echo "measured bf16 matmul peak: $PEAK"
B="bench/bench_parallel.py --model $MODEL --seq $SEQ --gbs $GBS --peak $PEAK"
python3 $B --hf-anchor --out "$O/t0_hf.json" > "$O/tput.log" 2>&1
$T --nproc-per-node 1 $B --out "$O/t1_1gpu.json" >> "$O/tput.log" 2>&1
$T --nproc-per-node 2 $B --tp 2 --sp --out "$O/t2_tp2.json" >> "$O/tput.log" 2>&1
$T --nproc-per-node 2 $B --dist-opt --out "$O/t3_dp2.json" >> "$O/tput.log" 2>&1
$T --nproc-per-node 2 $B --pp 2 --out "$O/t4_pp2.json" >> "$O/tput.log" 2>&1
if [ -n "${GBS_LARGE:-}" ]; then  # dp scaling once the gradient all-reduce is amortised over more micro batches
  $T --nproc-per-node 1 $B --gbs $GBS_LARGE --out "$O/t5_1gpu_gbs$GBS_LARGE.json" >> "$O/tput.log" 2>&1
  $T --nproc-per-node 2 $B --gbs $GBS_LARGE --dist-opt --out "$O/t6_dp2_gbs$GBS_LARGE.json" >> "$O/tput.log" 2>&1
fi
grep -m3 -B2 -A12 "Traceback" "$O/tput.log" | head -40
python3 bench/table.py "$O"/t*.json | tee "$O/throughput.md"
fi
[ -n "${OUT:-}" ] && { for f in "$O"/t*.json; do cat "$f"; echo; done > "$OUT/throughput.jsonl" 2>/dev/null; cp "$O"/*.md "$O"/*.txt "$O"/*.log "$OUT"/ 2>/dev/null; }
true

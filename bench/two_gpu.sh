#!/usr/bin/env bash
# Issue 16 in one device call on nvidia-h200-x2: NCCL bf16 parity of the 2-GPU layouts (overlap on)
# vs 1 GPU, then throughput of GPT-2 XL and the Llama 1.2B (bench/throughput.py's models) at dp2
# (overlap on and off), tp2+sp, pp2 (interleaved), against our 1 GPU and transformers + DDP.
#   bash bench/two_gpu.sh                 # on 2 GPUs
#   NPROC=1 bash bench/two_gpu.sh         # dry run on one GPU: every code path at world size 1
set -u
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1
N=${NPROC:-2}; O=/tmp/two_gpu; mkdir -p "$O"; STEPS=${STEPS:-5}
T="python3 -m torch.distributed.run --standalone --nproc-per-node"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"

echo "== parity (bf16, NCCL, overlap on)"
P="bench/gpu_parity.py --steps $STEPS"
$T 1 $P --out "$O/p0_ref.json" > "$O/parity.log" 2>&1
if [ "$N" -ge 2 ]; then
  $T 2 $P --tp 2 --sp --out "$O/p1.json" >> "$O/parity.log" 2>&1
  $T 2 $P --pp 2 --out "$O/p2.json" >> "$O/parity.log" 2>&1
  $T 2 $P --pp 2 --vpp 2 --out "$O/p3.json" >> "$O/parity.log" 2>&1
  $T 2 $P --overlap-grad-reduce --out "$O/p4.json" >> "$O/parity.log" 2>&1
  $T 2 $P --dist-opt --overlap-grad-reduce --overlap-param-gather --out "$O/p5.json" >> "$O/parity.log" 2>&1
else
  $T 1 $P --overlap-grad-reduce --out "$O/p4.json" >> "$O/parity.log" 2>&1
  $T 1 $P --dist-opt --overlap-grad-reduce --overlap-param-gather --out "$O/p5.json" >> "$O/parity.log" 2>&1
fi
python3 bench/gpu_parity.py --compare "$O"/p*.json | tee "$O/parity.txt"
grep -m2 -B2 -A12 "Traceback" "$O/parity.log" | head -40

PEAK=$(python3 bench/matmul_peak.py | python3 -c "import json,sys; print(json.load(sys.stdin)['bf16_matmul_flops'])")
echo "measured bf16 matmul peak: $PEAK"
for MODEL in ${MODELS:-gpt2-xl llama-1b}; do
  echo "== throughput $MODEL"
  B="bench/bench_parallel.py --model $MODEL --gbs ${GBS:-8} --steps $STEPS --peak $PEAK --compile"
  L="$O/t_$MODEL.log"; : > "$L"
  $T 1 $B --hf-ddp --out "$O/t_${MODEL}_0hf1.json" >> "$L" 2>&1
  $T 1 $B --out "$O/t_${MODEL}_1ours1.json" >> "$L" 2>&1
  $T "$N" $B --hf-ddp --out "$O/t_${MODEL}_2hfddp.json" >> "$L" 2>&1
  $T "$N" $B --out "$O/t_${MODEL}_3dp.json" >> "$L" 2>&1
  $T "$N" $B --overlap-grad-reduce --out "$O/t_${MODEL}_4dp_overlap.json" >> "$L" 2>&1
  $T "$N" $B --dist-opt --overlap-grad-reduce --overlap-param-gather --out "$O/t_${MODEL}_5dp_distopt.json" >> "$L" 2>&1
  if [ "$N" -ge 2 ]; then
    $T 2 $B --tp 2 --sp --out "$O/t_${MODEL}_6tp2.json" >> "$L" 2>&1
    $T 2 $B --pp 2 --vpp 2 --out "$O/t_${MODEL}_7pp2.json" >> "$L" 2>&1
  fi
  grep -m2 -B2 -A12 "Traceback" "$L" | head -30
  python3 bench/table.py "$O"/t_${MODEL}_*.json | tee "$O/throughput_$MODEL.md"
done
[ -n "${OUT:-}" ] && cp "$O"/*.md "$O"/*.txt "$O"/*.log "$OUT"/ 2>/dev/null
true

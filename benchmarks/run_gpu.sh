#!/usr/bin/env bash
# GPU validation and the committed GPU benchmarks, in one go (about 10 minutes on one H100/H200).
#   bash benchmarks/run_gpu.sh OUT_DIR [quick]
set -uo pipefail
out=${1:?usage: run_gpu.sh OUT_DIR [quick]}
mode=${2:-full}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
$py -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$out/gpu_tests.log"
if [ "$mode" = quick ]; then
  $py -m benchmarks.decode_floor --model llama-3.2-1b --batch 1 64 --isl 128 --json "$out/decode_floor_quick.json"
  exit 0
fi
$py -m benchmarks.decode_floor --model llama-3.2-1b --batch 1 8 64 256 --isl 128 --json "$out/decode_floor_llama1b.json"
$py -m benchmarks.profile_step --model llama-3.2-1b --batch 1 --json "$out/profile_runner_llama1b.json"
$py -m benchmarks.gemv --model llama-3.2-1b --json "$out/gemv_llama1b.json"
$py -m benchmarks.gemv --model llama-3.2-1b --chain --sweep --wait-cost --json "$out/gemv_chain_llama1b.json"
$py -m benchmarks.offline --model llama-3.2-1b --num-requests 256 --isl 100:1024 --osl 100:1024 --seed 0 \
    --baseline hf --hf-requests 64 --hf-batch-size 64 --profile --json "$out/offline_llama1b.json"
$py -m benchmarks.offline --model llama-3.1-8b --num-requests 256 --isl 100:1024 --osl 100:1024 --seed 0 \
    --json "$out/offline_llama8b.json"
$py -m benchmarks.decode_floor --model llama-3.1-8b --batch 1 8 64 256 --isl 128 --json "$out/decode_floor_llama8b.json"
# Tensor parallelism, where the host has two GPUs (NVLink multicast stays off: NCCL_NVLS_ENABLE=0).
if [ "$($py -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
  $py -m benchmarks.all_reduce --json "$out/all_reduce.json"
  $py -m benchmarks.decode_floor --model llama-3.1-8b --batch 1 8 64 256 --isl 128 \
      --tensor-parallel-size 2 --json "$out/decode_floor_llama8b_tp2.json"
  $py -m benchmarks.offline --model llama-3.1-8b --num-requests 256 --isl 100:1024 --osl 100:1024 --seed 0 \
      --tensor-parallel-size 2 --json "$out/offline_llama8b_tp2.json"
fi

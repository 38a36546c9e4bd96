#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run: the GPU tests (kernels compiled, CUDA-graph replay, the host tier's
# side-stream copies), then the GPU benchmarks (segmented LoRA kernels vs SGLang's, host-tier copies vs recompute,
# weights read in place from the unified pool vs stacked slot buffers, a step's LoRA work per module group: the
# simulator's LoRA term is fitted to it by `python -m eval.sim.lora_cost_report`), the one-tile path against the rank loop.
# Works on a machine with PyTorch, Triton and transformers but no SGLang: SGLang's LoRA kernels are staged from
# the installed wheel first (`python -m eval.bench.sglang_kernels .gpu_stage` where SGLang is installed) and
# carried in .gpu_stage/.
# Usage: scripts/gpu_checks.sh OUT_DIR [KERNEL_BENCH_SECONDS]
set -u
out=${1:?usage: scripts/gpu_checks.sh OUT_DIR [KERNEL_BENCH_SECONDS]}
budget=${2:-150}
mkdir -p "$out"
py=${PYTHON:-python3}
# `sgl_multilora.patches` is `patches/` once installed; without an install, a link stands in for the mapping.
[ -e sgl_multilora/patches ] || ln -s ../patches sgl_multilora/patches
export PYTHONPATH="$PWD/.gpu_stage:$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
$py -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
  | tee -a "$out/device.txt"
date -u +%FT%TZ | tee -a "$out/device.txt"
timeout 120 $py -m pytest -q -ra -p no:cacheprovider tests/gpu tests/unit/test_host_kv_store.py 2>&1 \
  | tee "$out/pytest_gpu.log" | tail -25
timeout 180 $py -m eval.bench.host_copy_gpu --out "$out/host_copy_gpu.jsonl" 2>&1 | tee "$out/host_copy_gpu.log" | tail -8
timeout 240 $py -m eval.bench.pool_views_gpu --out "$out/pool_views_gpu.jsonl" 2>&1 | tee "$out/pool_views_gpu.log" | tail -4
timeout $((budget + 150)) $py -m eval.bench.lora_kernels --max-seconds "$budget" --out "$out/lora_kernels.jsonl" \
  2>&1 | tee "$out/lora_kernels.log" | tail -4
timeout 420 $py -m eval.bench.lora_step_gpu --max-seconds 200 --layers 40 --rank-chunks 128,64,32 \
  --out "$out/lora_step_gpu.jsonl" 2>&1 | tee "$out/lora_step_gpu.log" | tail -2
timeout 300 $py -m eval.bench.rank_tile_ab --max-seconds 170 --out "$out/rank_tile_ab.jsonl" 2>&1 \
  | tee "$out/rank_tile_ab.log" | tail -3
ls -la "$out"

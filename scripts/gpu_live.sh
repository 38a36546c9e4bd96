#!/usr/bin/env bash
# One prepared live run on a GPU machine without SGLang (at most 10 minutes): installs the GPU kit (scripts/gpu_kit.sh
# built it into KIT, carried), then runs scripts/gpu_live.py: random-weight 1B-class Llama + random mixed-rank
# adapters, stock SGLang and ours one after the other, greedy check against PEFT, one fixed Zipf trace each.
# Results: OUT/gpu_live.json (rewritten after every phase), OUT/server_*.log, OUT/gpu_live.log.
# Dry run on a CPU (no kit needed, the venv's SGLang): GPU_LIVE_DRY_RUN=1 scripts/gpu_live.sh OUT
# Usage: scripts/gpu_live.sh OUT [KIT]   (KIT defaults to .gpu_kit)
# A device call carries at most 64 MiB with the kit; set the bundled adapters and result records aside for it:
#   scripts/gpu_kit.sh .gpu_kit && scripts/gpu_tree.sh out   # then, with the device tool:
#   run(command="scripts/gpu_live.sh $OUT .gpu_kit", carry=[".gpu_kit"], timeout_s=600); then scripts/gpu_tree.sh in
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu_live.sh OUT [KIT]}
kit=${2:-.gpu_kit}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ "${GPU_LIVE_DRY_RUN:-0}" = "1" ]; then
  py=${PYTHON:-.venv/bin/python}
  timeout 900 "$py" scripts/gpu_live.py --out "$out" --dry-run 2>&1 | tee "$out/gpu_live.log" | grep -v "^\[" | tail -5
  exit 0
fi
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt" || true
start=$(date +%s)
timeout 120 env PYTHON="$py" bash "$kit/install.sh" /tmp/sgl_kit 2>&1 | tee "$out/install.log"
# shellcheck disable=SC1091
source /tmp/sgl_kit/env.sh
echo "install: $(( $(date +%s) - start )) s" | tee -a "$out/install.log"
# Fails fast, before any model is built, if the kit cannot import SGLang's server path here.
timeout 120 "$py" -c "import sglang.srt.entrypoints.http_server, sgl_multilora.patches.plugin as p; p.register(); \
print('kit imports ok')" 2>&1 | tail -3 | tee -a "$out/install.log"
left=$(( 570 - ($(date +%s) - start) ))
timeout "$left" "$py" scripts/gpu_live.py --out "$out" --arm-timeout $(( (left - 120) / 2 )) 2>&1 \
  | tee "$out/gpu_live.log" | grep -v "^\[" | tail -40

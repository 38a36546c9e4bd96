#!/usr/bin/env bash
# Builds the GPU kit into DIR (at most 60 MiB): pruned SGLang 0.5.23 sources, this project as installed, the
# embedded model's tokenizer, and the wheels (CPython 3.12, manylinux x86_64) of what SGLang's server path needs that
# the GPU image lacks (scripts/gpu_kit.py: WHEELS; why each is there: its docstring). Wheels are downloaded once into
# .cache/gpu_kit_wheels (WHEEL_CACHE to change). On the GPU machine: `source DIR/install.sh` (see that file).
# Usage: scripts/gpu_kit.sh DIR [xz|gz]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu_kit.sh DIR [xz|gz]}
compression=${2:-xz}
py=${PYTHON:-.venv/bin/python}
cache=${WHEEL_CACHE:-.cache/gpu_kit_wheels}
mkdir -p "$cache"
missing=()
for spec in $($py scripts/gpu_kit.py wheels); do
  name=${spec%%==*}; version=${spec##*==}
  stem=$(echo "$name" | tr '-' '_')
  ls "$cache"/${stem}-${version}-*.whl >/dev/null 2>&1 || ls "$cache"/${name}-${version}-*.whl >/dev/null 2>&1 \
    || missing+=("$spec")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "gpu_kit: downloading ${missing[*]}"
  $py -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux1_x86_64 -d "$cache" "${missing[@]}"
fi
$py scripts/gpu_kit.py build "$out" --wheels "$cache" --compression "$compression"

#!/usr/bin/env bash
# Installs the GPU kit (scripts/gpu_kit.sh builds it) on a machine with Python 3.12, PyTorch, Triton and
# transformers but no SGLang, offline. Usage: bash KIT/install.sh [TARGET], then `source TARGET/env.sh`.
# TARGET defaults to /tmp/sgl_kit. Idempotent.
# Puts on PYTHONPATH: TARGET/site (pruned SGLang, sgl_multilora, their dist-infos: importlib.metadata finds the
# plugin's `sglang.srt.plugins` entry point there, no .pth needed) and the wheels installed with --target into it.
set -euo pipefail
kit=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
target=${1:-/tmp/sgl_kit}
py=${PYTHON:-python3}
mkdir -p "$target"
tar -xf "$kit"/site.tar.* -C "$target"
"$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check --upgrade \
  --target "$target/site" "$kit"/wheels/*.whl
cat > "$target/env.sh" <<ENV
export PYTHONPATH="$target/site\${PYTHONPATH:+:\$PYTHONPATH}"
export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
export SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python
export SGL_KIT_TOKENIZER="$target/tokenizer"
ENV
echo "kit installed in $target; now: source $target/env.sh"

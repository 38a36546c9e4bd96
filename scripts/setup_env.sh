#!/usr/bin/env bash
# Creates .venv for this project (idempotent: a second run installs nothing).
#  - CPU machine (no nvidia-smi): torch==2.13.0 (the local CPU build), then requirements/cpu.lock with --no-deps
#    (sglang 0.5.23 and its pure-Python needs, fully pinned), then this project in editable mode, then the
#    start-up hook that activates patches/cpu_compat.py in every Python process of the venv.
#  - GPU machine: the ordinary install, `pip install -e .[test]`, which brings sglang==0.5.23 and its dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
STAMP="$VENV/.setup-stamp"
want=$(cat scripts/setup_env.sh requirements/cpu.lock pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  echo "setup: $VENV is up to date"
  exit 0
fi
start=$(date +%s)
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/pip --disable-pip-version-check -q"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "setup: GPU found: ordinary install (sglang==0.5.23 with its dependencies)"
  $PIP install -e ".[test]" "$(grep '^smg==' requirements/cpu.lock)"  # smg: the router (sgl_multilora.cluster)
else
  echo "setup: no GPU: CPU install (torch 2.13.0+cpu, sglang 0.5.23 --no-deps, pinned pure-Python deps)"
  echo "torch==2.13.0" > "$VENV/constraints.txt"
  $PIP install "torch==2.13.0"
  $PIP install --no-deps -c "$VENV/constraints.txt" -r requirements/cpu.lock
  $PIP install --no-deps --no-build-isolation -e .
  site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "import sgl_multilora.patches.cpu_compat as _m; _m.install()" > "$site/sgl_multilora_cpu.pth"
fi
"$VENV/bin/python" -c "import sglang, sgl_multilora.patches.plugin" 
echo "$want" > "$STAMP"
echo "setup: done in $(( $(date +%s) - start )) s"

"""The GPU live run's dry run on a CPU (GPU_LIVE_DRY_RUN=1 scripts/gpu_live.sh OUT): the same driver with the embedded
model, fp32 and the CPU server flags: model, random adapters of mixed ranks, PEFT oracle, our arm's server checked
against the oracle and replaying the Zipf trace, with the JSON written phase by phase. Marked e2e: it starts a real
server (about two minutes on two cores), past the unit suite's budget."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_dry_run_writes_every_phase(tmp_path):
    env = {**os.environ, "GPU_LIVE_DRY_RUN": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(["bash", str(REPO / "scripts" / "gpu_live.sh"), str(tmp_path)], capture_output=True,
                            text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_live.json").read_text())
    phases = report["phases"]
    assert list(phases) == ["env", "model", "adapters", "oracle", "arm_ours", "done"]
    assert phases["env"]["dry_run"] and phases["env"]["versions"]["sglang"] == "0.5.23"
    assert phases["adapters"]["ranks"] == [8, 16, 8]
    arm = phases["arm_ours"]
    assert "error" not in arm, arm.get("error")
    assert arm["check"]["num_exact"] == arm["check"]["num"], arm["check"]["rows"]
    assert arm["replay"]["num_ok"] == arm["replay"]["num"] == 6

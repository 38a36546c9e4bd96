"""SGLang's own command-line tools run from the set-up environment as SGLang documents them (their imports, such as
`datasets` for the benchmark datasets and `tabulate` for the one-batch report, are installed, not stubbed)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module, expected", [
    ("sglang.bench_serving", "--dataset-name"),
    ("sglang.bench_one_batch_server", "--batch-size"),
    ("sglang.benchmark.offline_throughput", "--num-prompts"),
])
def test_tool_starts_and_prints_its_help(module, expected):
    result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert expected in result.stdout

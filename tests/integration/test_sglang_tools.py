"""SGLang's own command-line tools run from the set-up environment as SGLang documents them (their imports, such as
`datasets` for the benchmark datasets and `tabulate` for the one-batch report, are installed, not stubbed)."""

from __future__ import annotations

import pytest

from tests.conftest import SideBySide

TOOLS = [
    ("sglang.bench_serving", "--dataset-name"),
    ("sglang.bench_one_batch_server", "--batch-size"),
    ("sglang.benchmark.offline_throughput", "--num-prompts"),
]


@pytest.fixture(scope="module")
def runs():
    """Each tool's `python -m <tool> --help` in a fresh process, the three started side by side."""
    started = SideBySide({module: ["-m", module, "--help"] for module, _ in TOOLS}, timeout_s=300)
    yield started
    started.close()


@pytest.mark.parametrize("module, expected", TOOLS)
def test_tool_starts_and_prints_its_help(runs, module, expected):
    result = runs.result(module)
    assert result.returncode == 0, result.stderr[-3000:]
    assert expected in result.stdout

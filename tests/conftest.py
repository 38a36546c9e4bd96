"""Shared fixtures: the embedded model, the bundled adapters, the PEFT oracle, and a real CPU SGLang server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ADAPTERS_DIR = Path(os.environ.get("MULTILORA_TEST_ADAPTERS_DIR", REPO / "assets" / "adapters"))


SHARED_SERVER_MODULES = {"test_multi_lora_serving", "test_frontend_dsl", "test_lora_tree", "test_ingress", "test_live"}
"""Modules on the session's shared servers (`lora_server`, `tree_server`): one pytest-xdist worker runs them all, so
each server starts once."""


def pytest_configure(config):
    """A pytest-xdist worker gets a share of the CPUs of its own, its servers too (they inherit the affinity and
    OMP_NUM_THREADS): with two workers on two cores, two servers of two threads each spun on each other's cores and
    ran slower together than one after the other."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = sorted(os.sched_getaffinity(0))
    if worker is None or count < 2 or len(cores) < count:
        return
    import torch

    index = int(worker.removeprefix("gw"))
    share = set(cores[index * len(cores) // count:(index + 1) * len(cores) // count])
    os.sched_setaffinity(0, share)
    os.environ["OMP_NUM_THREADS"] = str(len(share))
    torch.set_num_threads(len(share))


def pytest_sessionfinish(session, exitstatus):
    """A run where too many oracle comparisons ended early at a near tie fails (see tests/oracle.py). A pytest-xdist
    worker hands its counts to the controller, which adds them up (`pytest_testnodedown`) and decides."""
    import dataclasses

    from tests.oracle import STATS

    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["oracle_stats"] = dataclasses.asdict(STATS)
        return
    if STATS.too_many_early() and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_testnodedown(node, error):
    """pytest-xdist (controller): a worker finished; its oracle counts join the run's."""
    from tests.oracle import STATS

    stats = getattr(node, "workeroutput", {}).get("oracle_stats")
    if stats is not None:
        STATS.merge(stats)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    from tests.oracle import MAX_EARLY_SHARE, STATS

    if not STATS.num_comparisons:
        return
    terminalreporter.write_line(STATS.summary())
    for what in STATS.early:
        terminalreporter.write_line(f"  ended early: {what}")
    if STATS.too_many_early():
        terminalreporter.write_line(
            f"FAILED: more than {MAX_EARLY_SHARE:.0%} of the oracle comparisons ended early at a near tie; "
            "choose prompts whose greedy outputs have no near ties", red=True)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (`make test` runs `-n 2`) each module goes to one worker whole (its module-scoped server
    starts once), and the modules on the shared servers go to one worker together (each shared server starts once).
    In collection order, not xdist's default of the most tests first: the end-to-end modules (`tests/e2e/` collects
    first), each minutes long with few tests, start early, and the hundreds of short unit tests fill the end."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "shared servers" if Path(path).stem in SHARED_SERVER_MODULES else path

    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """GPU tests are skipped without a GPU."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_path() -> str:
    from sgl_multilora.embedded import ensure_embedded_model

    return str(ensure_embedded_model())


@pytest.fixture(scope="session")
def moe_model_path(model_path) -> str:
    """The embedded MoE model (`sgl_multilora.embedded_moe`: the dense model upcycled into a 4-expert Mixtral)."""
    from sgl_multilora.embedded_moe import ensure_embedded_moe_model

    return str(ensure_embedded_moe_model())


@pytest.fixture(scope="session")
def manifest() -> list[dict]:
    """The bundled adapters (assets/adapters/manifest.json), each with its absolute `path`."""
    entries = json.loads((ADAPTERS_DIR / "manifest.json").read_text())
    entries = entries["adapters"] if isinstance(entries, dict) else entries
    return [{**e, "path": str(ADAPTERS_DIR / e["name"])} for e in entries]


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="session")
def oracle(model_path, tokenizer):
    from tests.oracle import PeftOracle

    return PeftOracle(model_path, eos_token_ids={tokenizer.eos_token_id})


class SideBySide:
    """Python subprocesses started together, each run as `subprocess.run([sys.executable, *args])` would run it
    alone (its own process, its output captured): a module whose tests each start Python and import SGLang (about
    9 s of one core each) waits for the slowest instead of the sum. Outputs go to files, so no process stalls on a
    full pipe while another is read."""

    def __init__(self, commands: dict[str, list[str]], timeout_s: float):
        self.deadline = time.monotonic() + timeout_s
        self.runs = {}
        for key, args in commands.items():
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            process = subprocess.Popen([sys.executable, *args], stdout=out, stderr=err, text=True)
            self.runs[key] = (process, out, err)

    def result(self, key: str) -> subprocess.CompletedProcess:
        """`key`'s process once it exited (subprocess.TimeoutExpired past the deadline)."""
        process, out, err = self.runs[key]
        process.wait(timeout=max(0.0, self.deadline - time.monotonic()))
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(process.args, process.returncode, out.read(), err.read())

    def close(self) -> None:
        for process, out, err in self.runs.values():
            if process.poll() is None:
                process.kill()
                process.wait()
            out.close()
            err.close()


def start_server(model_path: str, extra_args: list[str], name: str, *, max_total_tokens: int | None = None,
                 env: dict[str, str] | None = None, overlap: bool = False):
    """Starts a CPU server for one test module; the caller stops it (killed half a second after SIGTERM: a test
    server has nothing to drain, and SGLang's graceful stop waits for a 5-second tick). Logs go to
    .pytest_cache/<name>.log. `overlap`: SGLang's overlap scheduler on (its default on GPUs), which the CPU
    servers otherwise run without; MULTILORA_TEST_OVERLAP=1 turns it on for every test server."""
    from sgl_multilora.server import cpu_server_args, launch

    log_dir = REPO / ".pytest_cache"
    log_dir.mkdir(exist_ok=True)
    max_total_tokens = max_total_tokens or int(os.environ.get("MULTILORA_TEST_MAX_TOKENS", "8192"))
    args = cpu_server_args(max_total_tokens=max_total_tokens)
    if overlap or os.environ.get("MULTILORA_TEST_OVERLAP") == "1":
        args = [a for a in args if a != "--disable-overlap-schedule"] + ["--multilora-stock-baseline", "cpu-overlap"]
    handle = launch(
        model_path,
        [*args, *extra_args],
        log_path=log_dir / f"{name}.log",
        env=env,
    )
    handle.stop_grace_s = 0.5
    return handle


# Servers shared by the e2e modules (one start each per session: a start costs most of a minute on 2 cores). Tests
# on a shared server measure deltas of counters and use prompts of their own, so module order does not matter.
LORA_SERVER_ARGS = ["--multilora-adapter-dir", str(ADAPTERS_DIR), "--max-loras-per-batch", "8",
                    "--max-lora-rank", "32"]
TREE_CHUNK = 64  # small chunked-prefill size, so long prompts are prefilled in several steps


@pytest.fixture(scope="session")
def lora_server(model_path):
    """Every bundled adapter, SGLang's own prefix cache (the plugin's default serving path)."""
    handle = start_server(model_path, LORA_SERVER_ARGS, name="e2e_lora_server")
    yield handle
    handle.stop()


@pytest.fixture(scope="session")
def tree_server(model_path):
    """Every bundled adapter, `--radix-cache-backend multilora`, chunked prefill of TREE_CHUNK tokens."""
    handle = start_server(
        model_path,
        [*LORA_SERVER_ARGS, "--radix-cache-backend", "multilora", "--chunked-prefill-size", str(TREE_CHUNK)],
        name="e2e_tree_server",
    )
    yield handle
    handle.stop()

"""Start and stop a real SGLang server in a subprocess (used by the demo, the tests and the eval harness).

Lives here: building the `python -m sglang.launch_server` command line, waiting for readiness, shutting the whole
process tree down. Not here: anything that imports SGLang (the server runs in its own processes).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


def cpu_server_args(max_total_tokens: int = 8192) -> list[str]:
    """The flags a CPU server needs: the transformers model path (SGLang's native models need GPU kernels),
    torch_native attention, fp32 (the PEFT oracle's dtype), a bounded KV pool, an idle scheduler that sleeps
    instead of polling (an idle polling scheduler takes a whole core from everything else on a small machine), and no
    overlap scheduler: on a CPU the forward runs in the scheduler's own thread, so overlapping only defers each
    batch's results (a prefill's first token) until the next batch's forward has finished, one decode step later
    (measured: eval/RESULTS.md, the CPU server path). Every arm of every benchmark gets these flags alike."""
    return [
        "--sleep-on-idle",
        "--disable-overlap-schedule",
        "--device", "cpu",
        "--model-impl", "transformers",
        "--attention-backend", "torch_native",
        "--dtype", "float32",
        "--max-total-tokens", str(max_total_tokens),
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerHandle:
    """A running server. `url` is its base address; `log_path` holds its stdout and stderr. `stop_grace_s`: how long
    `stop` lets SGLang drain after SIGTERM before it kills the process group (None: up to `stop`'s `timeout_s`;
    SGLang notices SIGTERM on a 5-second tick, so a graceful stop takes about 5 s)."""

    url: str
    process: subprocess.Popen
    log_path: Path
    command: list[str] = field(default_factory=list)
    stop_grace_s: float | None = None

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stops the server and every process it spawned. Idempotent."""
        if self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=timeout_s if self.stop_grace_s is None else self.stop_grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=timeout_s)


class ServerStartError(RuntimeError):
    pass


def _stop_with_parent() -> None:
    """Runs in the server's process before it execs (Linux): SIGTERM it when the process that launched it dies,
    so a test or benchmark killed by a time-out never leaves a server behind (SGLang's own processes already
    follow the launcher's death)."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def launch(
    model_path: str | os.PathLike,
    extra_args: Sequence[str] = (),
    *,
    port: int | None = None,
    log_path: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 300.0,
    python: str = sys.executable,
) -> ServerHandle:
    """Starts `python -m sglang.launch_server` and returns once `/health_generate` answers 200. Call it from the
    thread that outlives the server (on Linux the server is stopped when the launching thread's process exits).

    Raises ServerStartError with the end of the server's log if it exits or does not become ready in time. A server
    whose HTTP port was taken between `free_port` and its bind (SGLang's own processes pick ports too) logs the bind
    error and never becomes ready: with the port chosen here it is stopped and started again on another, at most
    `PORT_RETRIES` times; with the caller's port that is an error at once.
    """
    error = None
    for _ in range(1 if port is not None else PORT_RETRIES + 1):
        try:
            return _launch_once(model_path, extra_args, port or free_port(), log_path, env, ready_timeout_s, python)
        except _PortTaken as e:
            error = e
    raise ServerStartError(str(error))


PORT_RETRIES = 2


class _PortTaken(ServerStartError):
    pass


def _launch_once(model_path, extra_args, port: int, log_path, env, ready_timeout_s: float,
                 python: str) -> ServerHandle:
    log_path = Path(log_path or f"/tmp/sgl_multilora_server_{port}.log")
    command = [
        python, "-m", "sglang.launch_server", "--model-path", str(model_path),
        "--host", "127.0.0.1", "--port", str(port), *extra_args,
    ]
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
    log = open(log_path, "w")
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True,
        preexec_fn=_stop_with_parent if sys.platform.startswith("linux") else None,
    )
    log.close()
    handle = ServerHandle(url=f"http://127.0.0.1:{port}", process=process, log_path=log_path, command=command)
    deadline = time.monotonic() + ready_timeout_s
    bind_error = f"('127.0.0.1', {port}): address already in use"
    while time.monotonic() < deadline:
        if bind_error in handle.log_tail():
            handle.stop(timeout_s=10.0)
            raise _PortTaken(f"port {port} was taken before the server could bind it; log {log_path}")
        if not handle.alive():
            raise ServerStartError(
                f"server exited with code {process.returncode} during start-up; log {log_path}:\n{handle.log_tail()}"
            )
        try:
            with urllib.request.urlopen(handle.url + "/health_generate", timeout=30) as response:
                if response.status == 200:
                    return handle
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.25)
    handle.stop()
    raise ServerStartError(f"server not ready after {ready_timeout_s:.0f} s; log {log_path}:\n{handle.log_tail()}")

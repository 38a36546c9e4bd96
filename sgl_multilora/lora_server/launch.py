"""Starting a LoRA server process from Python (`python -m sgl_multilora.lora_server` as a child), for the cluster
launcher, the benchmarks and the tests: `LoRAServerProcess.start()` returns once the server answers `hello`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path


class LoRAServerStartError(RuntimeError):
    pass


class LoRAServerProcess:
    """One LoRA server child process serving `adapter_dir` for the base model at `model_path` on `address`
    (ipc://PATH or tcp://HOST:PORT); `extra_args` go to its command line (e.g. ["--max-slots", "8"]). Its output
    is appended to `log_path`. `start` may be called again after `stop` (a restart on the same address)."""

    def __init__(self, adapter_dir: str | os.PathLike, model_path: str | os.PathLike, address: str,
                 log_path: str | os.PathLike, extra_args: Sequence[str] = (), python: str = sys.executable):
        self.command = [python, "-m", "sgl_multilora.lora_server", "--adapter-dir", str(adapter_dir),
                        "--model-path", str(model_path), "--listen", address, *extra_args]
        self.address, self.log_path = address, Path(log_path)
        self.process: subprocess.Popen | None = None

    def start(self, ready_timeout_s: float = 300.0) -> LoRAServerProcess:
        """Starts the process and waits until it answers `hello`. Raises LoRAServerStartError (with the end of its
        log) if it exits or does not answer within `ready_timeout_s`."""
        from sgl_multilora.lora_server.client import LoRAServerClient

        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        client, deadline = LoRAServerClient(self.address, timeout_s=1.0), time.monotonic() + ready_timeout_s
        try:
            while True:
                try:
                    client.catalog()
                    return self
                except ConnectionError:
                    if self.process.poll() is not None or time.monotonic() > deadline:
                        self.stop()
                        raise LoRAServerStartError(f"the LoRA server on {self.address} did not start; its log "
                                                   f"{self.log_path} ends with:\n{self.log_tail()}") from None
        finally:
            client.close()

    def stats(self, timeout_s: float = 10.0) -> dict:
        """The server's `stats` reply (counters and its idle invariants check)."""
        from sgl_multilora.lora_server.client import LoRAServerClient

        client = LoRAServerClient(self.address, timeout_s=timeout_s)
        try:
            return client.stats()
        finally:
            client.close()

    def log_tail(self, num_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`; a no-op when not running."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

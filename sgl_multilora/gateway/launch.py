"""N SGLang workers with the plugin behind SGLang's router, `smg` (PyPI `smg`, formerly `sglang-router`).

Lives here: starting N `python -m sglang.launch_server` workers (the plugin loads through its entry point as in
any server), waiting until each answers `/health_generate`, starting `smg launch` in front of them with a routing
policy, and stopping the whole lot (each in its own process group, SIGTERM then SIGKILL, and every process also
follows its launcher's death). `Cluster` is the Python API (a context manager); `python -m sgl_multilora.cluster`
is the command line (cli.py). Not here: placement of adapters or KV across workers (sgl_multilora/cluster/, the
pure placement core; smg's own policies route here), and anything that imports SGLang or smg.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Self

from sgl_multilora.server import ServerHandle, ServerStartError, _stop_with_parent, free_port

SMG_VERSION = "1.13.0"  # the router version this launcher is checked against (requirements/cpu.lock pins it)
# `smg launch --policy` choices of smg 1.13.0 (`passthrough` and the PD-only `bucket` left out).
SMG_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "least_load", "consistent_hashing",
                "prefix_hash", "manual")
# Ours: smg with consistent_hashing (it honours X-SMG-Target-Worker) behind our gateway (app.py).
LORA_AWARE = "lora_aware"
POLICIES = (LORA_AWARE, *SMG_POLICIES)
# Flags the launcher sets itself on every worker.
RESERVED_WORKER_FLAGS = ("--host", "--port")
PORT_TRIES = 3  # starts of the router or the gateway on new ports when theirs is taken
ADMIN_KEY_FLAG = "--admin-api-key"
ADMIN_KEY_ENV = "SGL_MULTILORA_WORKER_ADMIN_KEY"  # how the gateway gets it (app.py reads it)
# The workers' `--api-key`, when the operator gives one: smg gets it too (it presents it to the workers and wants it
# from clients), and so does the gateway (it wants it from clients and presents it on its own calls).
API_KEY_FLAG = "--api-key"
API_KEY_ENV = "SGL_MULTILORA_API_KEY"


class ClusterError(ServerStartError):
    """A worker or the router did not start; the message ends with the tail of its log."""


def smg_available() -> bool:
    return importlib.util.find_spec("smg") is not None


def bearer(key: str | None) -> dict[str, str]:
    """The `Authorization` header that presents `key` (none without a key)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def _ready(url: str, timeout_s: float = 30.0, headers: dict[str, str] | None = None) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def _spawn(command: list[str], log_path: Path, url: str, env: dict[str, str] | None = None) -> ServerHandle:
    """Starts `command` in a new process group (stopped with its launcher on Linux); does not wait."""
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, **(env or {})},
            preexec_fn=_stop_with_parent if sys.platform.startswith("linux") else None,
        )
    return ServerHandle(url=url, process=process, log_path=log_path, command=command)


class Cluster:
    """`num_workers` workers started with `worker_args` (which must include `--model-path`; `--host`/`--port`
    are set here) behind smg with `policy`. With `router_port` P the workers listen on P+1..P+N, without it on
    free ports. Use as a context manager: `with Cluster(2, args) as c: requests.post(c.router_url + ...)`.
    `router_args` go to `smg launch` after the launcher's own flags (so they override them)."""

    def __init__(self, num_workers: int, worker_args: Sequence[str], *, policy: str = "cache_aware",
                 router_port: int | None = None, host: str = "127.0.0.1", router_args: Sequence[str] = (),
                 log_dir: str | os.PathLike | None = None, ready_timeout_s: float = 600.0,
                 env: dict[str, str] | None = None, python: str = sys.executable,
                 gateway_args: Sequence[str] = ()):
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
        if "--model-path" not in worker_args:
            raise ValueError("worker_args must include --model-path")
        reserved = [flag for flag in RESERVED_WORKER_FLAGS if flag in worker_args]
        if reserved:
            raise ValueError(f"{' and '.join(reserved)} are set per worker by the launcher; leave them out")
        self.num_workers, self.worker_args, self.policy = num_workers, list(worker_args), policy
        self.host, self.router_args, self.ready_timeout_s = host, list(router_args), ready_timeout_s
        self.env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
        self.python = python
        self.gateway_args = list(gateway_args)
        self._ports: set[int] = set()  # every port handed out here: free_port() alone may return one twice
        self.router_port = router_port or self._free_port()
        self._router_port_fixed = router_port is not None
        self._ports.add(self.router_port)
        self.worker_ports = ([self.router_port + 1 + i for i in range(num_workers)] if router_port
                             else [self._free_port() for _ in range(num_workers)])
        self._ports.update(self.worker_ports)
        self.metrics_port = self._free_port()
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="sgl_multilora_cluster_"))
        self.workers: list[ServerHandle] = []
        self.router: ServerHandle | None = None
        self.gateway: ServerHandle | None = None
        self.gateway_port = self._free_port() if policy == LORA_AWARE else None
        # The workers' admin key: the gateway moves KV through their admin routes (patches/kv_transfer.py). The
        # operator's own `--admin-api-key`, or one made here (readable by the owner only, in the log directory).
        if ADMIN_KEY_FLAG in self.worker_args:
            self.admin_api_key = self.worker_args[self.worker_args.index(ADMIN_KEY_FLAG) + 1]
            self.admin_key_file: Path | None = None
        else:
            self.admin_api_key = secrets.token_hex(24)  # hex: never starts with "-", which argparse would take for a flag
            self.worker_args += [ADMIN_KEY_FLAG, self.admin_api_key]
            self.admin_key_file = self.log_dir / "admin-api-key"
        self.api_key = (self.worker_args[self.worker_args.index(API_KEY_FLAG) + 1]
                        if API_KEY_FLAG in self.worker_args else None)

    def _free_port(self) -> int:
        """A free port none of this cluster's processes was given (a worker that took the router's port made the
        router fail to start: "Address already in use")."""
        while (port := free_port()) in self._ports:
            pass
        self._ports.add(port)
        return port

    @property
    def admin_headers(self) -> dict[str, str]:
        """What a client sends to a worker's admin routes (`/flush_cache`, `/load_lora_adapter`, ...) and to the
        gateway's `/cluster/migrate`."""
        return bearer(self.admin_api_key)

    @property
    def client_headers(self) -> dict[str, str]:
        """What a client sends with every other request: the workers' `--api-key` when they have one (the router
        and the gateway want it too), else nothing."""
        return bearer(self.api_key)

    @property
    def router_url(self) -> str:
        return f"http://{self.host}:{self.router_port}"

    @property
    def url(self) -> str:
        """Where clients send requests: the gateway with `lora_aware`, else the router."""
        return f"http://{self.host}:{self.gateway_port}" if self.gateway_port else self.router_url

    @property
    def worker_urls(self) -> list[str]:
        return [f"http://{self.host}:{port}" for port in self.worker_ports]

    @property
    def metrics_url(self) -> str:
        """smg's Prometheus endpoint (its own listener, not on the router port)."""
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def router_command(self) -> list[str]:
        return [self.python, "-m", "smg", "launch", "--host", self.host, "--port", str(self.router_port),
                "--worker-urls", *self.worker_urls,
                "--policy", "consistent_hashing" if self.policy == LORA_AWARE else self.policy,
                "--prometheus-host", self.host, "--prometheus-port", str(self.metrics_port),
                # smg drains in-flight requests for 180 s on SIGTERM by default; our stop waits 30 s at most
                "--shutdown-grace-period-secs", "5", "--log-level", "warn",
                *([API_KEY_FLAG, self.api_key] if self.api_key else []), *self.router_args]

    def gateway_command(self) -> list[str]:
        return [self.python, "-m", "sgl_multilora.gateway.app", "--host", self.host,
                "--port", str(self.gateway_port), "--router-url", self.router_url,
                "--worker-urls", *self.worker_urls, *self.gateway_args]

    def start(self) -> Self:
        if not smg_available():
            raise ClusterError(f"the router `smg` is not installed in {self.python}; "
                               f"install it with `pip install smg=={SMG_VERSION}`")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.admin_key_file is not None:
            fd = os.open(self.admin_key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.admin_api_key + "\n")
        try:
            for i, (port, url) in enumerate(zip(self.worker_ports, self.worker_urls)):
                command = [self.python, "-m", "sglang.launch_server", *self.worker_args,
                           "--host", self.host, "--port", str(port)]
                self.workers.append(_spawn(command, self.log_dir / f"worker{i}.log", url, self.env))
            self._wait(self.workers, "/health_generate", "worker")
            self._start_front()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_front(self) -> None:
        def router():
            self.router = _spawn(self.router_command(), self.log_dir / "router.log", self.router_url)
            return self.router

        def gateway():
            url = f"http://{self.host}:{self.gateway_port}"
            self.gateway = _spawn(self.gateway_command(), self.log_dir / "gateway.log", url,
                                  {**self.env, ADMIN_KEY_ENV: self.admin_api_key, API_KEY_ENV: self.api_key or ""})
            return self.gateway

        def new_router_ports():
            self.router_port, self.metrics_port = self._free_port(), self._free_port()

        self._start_bound(router, "/readiness", "router", new_router_ports, fixed=self._router_port_fixed)
        self._wait_registered()
        if self.gateway_port:
            self._start_bound(gateway, "/cluster/stats", "gateway",
                              lambda: setattr(self, "gateway_port", self._free_port()))

    def _start_bound(self, start, path: str, what: str, new_ports, fixed: bool = False) -> None:
        """`start()` until what it starts answers `path`. A worker's SGLang takes free ports of its own (its
        process group's init port, near its HTTP port) after ours were chosen and may take one of them: a front
        that finds its port in use moves to new ones (`new_ports()`), unless its port was the operator's."""
        for attempt in range(PORT_TRIES):
            handle = start()
            try:
                self._wait([handle], path, what)
                return
            except ClusterError as e:
                if "address already in use" not in str(e).lower() or fixed or attempt == PORT_TRIES - 1:
                    raise
                handle.stop()
                new_ports()

    def _stop_front(self) -> None:
        for handle in (self.gateway, self.router):
            if handle is not None:
                handle.stop()
        self.gateway = self.router = None

    def set_policy(self, policy: str) -> None:
        """Restarts the router (and the gateway) with `policy`; the workers, and what they cache, stay."""
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
        self._stop_front()
        self.policy = policy
        self.gateway_port = (self.gateway_port or self._free_port()) if policy == LORA_AWARE else None
        try:
            self._start_front()
        except BaseException:
            self.stop()
            raise

    def _wait(self, handles: list[ServerHandle], path: str, what: str) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        pending = list(handles)
        while pending:
            for handle in list(pending):
                if not handle.alive():
                    raise ClusterError(f"{what} {handle.url} exited with code {handle.process.returncode} during "
                                       f"start-up; log {handle.log_path}:\n{handle.log_tail()}")
                if _ready(handle.url + path, headers=self.client_headers):
                    pending.remove(handle)
            if pending and time.monotonic() > deadline:
                handle = pending[0]
                raise ClusterError(f"{what} {handle.url} not ready after {self.ready_timeout_s:.0f} s; "
                                   f"log {handle.log_path}:\n{handle.log_tail()}")
            if pending:
                time.sleep(0.25)

    def _wait_registered(self) -> None:
        """Until smg lists every worker as ready (it registers them in the background after it listens)."""
        deadline = time.monotonic() + 120.0
        while True:
            try:
                request = urllib.request.Request(self.router_url + "/workers", headers=self.client_headers)
                with urllib.request.urlopen(request, timeout=10) as response:
                    workers = json.loads(response.read())["workers"]
                if sum(w.get("status") == "ready" for w in workers) >= self.num_workers:
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, KeyError, ValueError):
                pass
            if not self.router.alive() or time.monotonic() > deadline:
                raise ClusterError(f"router did not register the {self.num_workers} workers; "
                                   f"log {self.router.log_path}:\n{self.router.log_tail()}")
            time.sleep(0.5)

    def restart_worker(self, index: int) -> None:
        """Starts worker `index` again with its own command (after it stopped or failed) and waits until it serves.
        The router and the gateway take it back once their health checks see it (`set_policy` restarts them)."""
        old = self.workers[index]
        old.stop()
        self.workers[index] = _spawn(old.command, old.log_path, old.url, self.env)
        self._wait([self.workers[index]], "/health_generate", "worker")

    def exited(self) -> list[ServerHandle]:
        """The processes that have exited (empty while the whole cluster runs)."""
        return [h for h in [*self.workers, *(h for h in (self.router, self.gateway) if h)] if not h.alive()]

    def stop(self) -> None:
        """Stops the gateway and the router first (no new requests reach a stopping worker), then every worker.
        Idempotent."""
        self._stop_front()
        for handle in self.workers:  # SIGTERM all first: a worker takes seconds to stop, they stop together
            if handle.alive():
                try:
                    os.killpg(handle.process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for handle in self.workers:
            handle.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

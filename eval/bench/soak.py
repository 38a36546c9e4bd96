"""Soak benchmark: one server under mixed traffic for a long time must never stop and never leak.
Here: the command line, the server, the phase loop and the checks after each phase.
Not here: the traffic (soak_traffic.py, soak_churn.py), outcomes and verdicts (soak_outcomes.py,
soak_report.py).

Each phase (about `--phase-minutes`) runs a small thread pool of base, LoRA and aLoRA requests,
streaming and not, plus adapter load/unload churn with requests aimed at the churned adapters,
clients that hang up mid-stream, `/abort_request` calls and bad inputs. After each phase: wait until
no request runs or waits, unload leftover copies, check the KV accounting closes, record the RSS of
the server's process tree and its adapter bytes. Phase 1 is the warm-up for the RSS rule.
Results: eval/results/soak/soak.jsonl (one line per phase, then a summary line) and soak.md.

Usage: .venv/bin/python -m eval.bench.soak [--minutes 20] [--url http://127.0.0.1:PORT]
       [--server-args "--multilora-scheduler multiqueue"] [--out eval/results/soak/soak_multiqueue]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

import psutil
import requests

from eval.bench.soak_churn import Churn
from eval.bench.soak_outcomes import AdminRecord, PhaseCheck, RequestRecord, summarize_phase
from eval.bench.soak_report import criteria, progress_line, render_markdown
from eval.bench.soak_traffic import Client, Planner, Prompts, find_adapters

if TYPE_CHECKING:
    from sgl_multilora.server import ServerHandle

REPO = Path(__file__).resolve().parents[2]
LOOPBACK = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class Server:
    """The server under test: address, the pid whose process tree is measured, a liveness probe
    that does not touch HTTP, and a line for the report."""

    url: str
    pid: int
    alive: Callable[[], bool]
    description: str


def server_args(adapters_dir: Path, max_total_tokens: int) -> list[str]:
    from sgl_multilora.server import cpu_server_args

    return [*cpu_server_args(max_total_tokens=max_total_tokens), "--enable-lora",
            "--multilora-adapter-dir", str(adapters_dir), "--radix-cache-backend", "multilora",
            "--max-loras-per-batch", "4", "--max-lora-rank", "32"]


def listening_pid(url: str) -> int:
    """The process listening on the URL's port (SGLang's HTTP process, parent of the others)."""
    port = urlparse(url).port
    for conn in psutil.net_connections(kind="tcp"):
        listening = conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN
        if listening and conn.pid:
            return conn.pid
    raise RuntimeError(f"no process listens on port {port}; pass --pid")


def process_tree_rss(pid: int) -> tuple[int, dict[str, int]]:
    """Summed RSS of a process and its descendants, and RSS by 'name[pid]'. (0, {}) if gone."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, {}
    by_process = {}
    for proc in procs:
        try:
            by_process[f"{proc.name()}[{proc.pid}]"] = proc.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return sum(by_process.values()), by_process


def read_memory(url: str) -> list[dict]:
    """The `/multilora/stats` memory entries, one per scheduler."""
    response = requests.get(url + "/multilora/stats", timeout=60)
    response.raise_for_status()
    memory = response.json().get("memory") or []
    if not memory or any(m is None for m in memory):
        raise RuntimeError(f"{url}/multilora/stats reports no KV accounting: {response.text[:300]}")
    return memory


def wait_idle(url: str, timeout_s: float) -> tuple[bool, float, list[dict]]:
    """Polls until no scheduler has a running or waiting request: (idle, seconds waited, memory)."""
    start = time.monotonic()
    while True:
        memory = read_memory(url)
        idle = all(m["running"] == 0 and m["waiting"] == 0 for m in memory)
        waited = time.monotonic() - start
        if idle or waited > timeout_s:
            return idle, waited, memory
        time.sleep(0.5)


def adapter_state(memory: list[dict]) -> tuple[int, list[str]]:
    """Adapter bytes summed over schedulers and the adapter names any scheduler holds weights of (the copy layers
    compute with, or, with the unified pool, the host copy a resident adapter is loaded from)."""
    entries = [m.get("adapters") or {} for m in memory]
    names = sorted({n for a in entries for n in (*a.get("weights", {}), *a.get("host", {}))})
    return sum(a.get("total", 0) for a in entries), names


def check_server(server: Server, churn: Churn, idle_timeout_s: float) -> PhaseCheck:
    """Waits for idle, unloads copies that requests loaded again, then reads the accounting."""
    if not server.alive():
        return PhaseCheck(idle=False, idle_wait_s=0.0, alive=False)
    try:
        idle, waited, memory = wait_idle(server.url, idle_timeout_s)
        churn.cleanup(adapter_state(memory)[1])
        memory = read_memory(server.url)
        idle = idle and all(m["running"] == 0 and m["waiting"] == 0 for m in memory)
        healthy = requests.get(server.url + "/health", timeout=30).status_code == 200
    except (requests.RequestException, RuntimeError) as e:
        print(f"  check failed: {type(e).__name__}: {e}", flush=True)
        return PhaseCheck(idle=False, idle_wait_s=0.0, alive=server.alive())
    rss, by_process = process_tree_rss(server.pid)
    adapter_bytes, names = adapter_state(memory)
    return PhaseCheck(idle, waited, server.alive() and healthy, memory, rss, by_process,
                      adapter_bytes, names)


def run_phase(client: Client, planner: Planner, churn: Churn, duration_s: float,
              concurrency: int, alive: Callable[[], bool]) -> list[RequestRecord]:
    """Traffic for `duration_s`, then drain: every request loop ends by the deadline plus one
    request's timeout. Admin calls go to `client.admin`. Stops early if the server dies."""
    records: list[RequestRecord] = []
    stop = threading.Event()
    deadline = time.monotonic() + duration_s

    def worker() -> None:
        while not stop.is_set() and time.monotonic() < deadline:
            records.append(client.send(planner.next()))

    churner = threading.Thread(target=churn.run, args=(stop,), daemon=True)
    churner.start()
    churn.wait_for_target(timeout_s=min(60.0, duration_s / 2))
    planner.start_phase()
    with ThreadPoolExecutor(concurrency) as pool:
        try:
            futures = [pool.submit(worker) for _ in range(concurrency)]
            while time.monotonic() < deadline and alive():
                time.sleep(1.0)
        finally:  # also on Ctrl-C: the workers and the churn end after their current call
            stop.set()
        for f in futures:
            f.result()
    churner.join()
    return records


def machine_info() -> dict:
    """Cores this process may use (as `nproc` counts them) and the load average at the start."""
    return {"nproc": len(os.sched_getaffinity(0)),
            "loadavg_start": [round(x, 2) for x in os.getloadavg()]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="total traffic time")
    parser.add_argument("--phase-minutes", type=float, default=2.0,
                        help="about this long per phase; at least two phases (warm-up + one)")
    parser.add_argument("--url", help="instead of starting one: a running loopback server with "
                        "the embedded model, the bundled adapters and --enable-lora")
    parser.add_argument("--pid", type=int, help="with --url: the server's process (for RSS)")
    parser.add_argument("--concurrency", type=int, default=4, help="request threads")
    parser.add_argument("--max-total-tokens", type=int, default=4096,
                        help="KV slots of the started server (small: the cache fills and evicts)")
    parser.add_argument("--adapters-dir", type=Path, default=REPO / "assets" / "adapters")
    parser.add_argument("--server-args", default="",
                        help="more arguments for the started server, one string (e.g. "
                             "\"--multilora-scheduler multiqueue\")")
    # On the quiet 2-core machine an answer takes seconds; 300 s is two orders of magnitude more,
    # so a timeout means a hang, not a slow step. Other jobs on the cores slow decoding down by
    # 10x or more: raise it there rather than count their load as server failures.
    parser.add_argument("--request-timeout-s", type=float, default=300.0,
                        help="longest wait for any answer or stream chunk: past it, a failure")
    parser.add_argument("--idle-timeout-s", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--records", type=Path,
                        help="also write every request and admin call as a JSON line here")
    parser.add_argument("--out", type=Path, default=REPO / "eval" / "results" / "soak" / "soak",
                        help="writes OUT.jsonl and OUT.md (replaced)")
    args = parser.parse_args(argv)
    if args.url and urlparse(args.url).hostname not in LOOPBACK:
        parser.error(f"--url must be a loopback address ({', '.join(LOOPBACK)}), got {args.url}")
    if args.minutes <= 0 or args.phase_minutes <= 0:
        parser.error("--minutes and --phase-minutes must be positive")
    return args


def start_server(args: argparse.Namespace, model_path: Path) -> tuple[ServerHandle, Server]:
    """Starts the CPU server; returns its handle and Server record."""
    from sgl_multilora.server import launch

    extra = server_args(args.adapters_dir, args.max_total_tokens) + shlex.split(args.server_args)
    print(f"starting a CPU server: {shlex.join(extra)}", flush=True)
    handle = launch(model_path, extra)
    print(f"server at {handle.url}, log {handle.log_path}", flush=True)
    description = f"server started by the benchmark with `{shlex.join(extra)}`"
    return handle, Server(handle.url, handle.process.pid, handle.alive, description)


def attach_server(args: argparse.Namespace) -> Server:
    url = args.url.rstrip("/")
    pid = args.pid or listening_pid(url)

    def alive() -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return Server(url, pid, alive, f"server at {url} (pid {pid}), started outside the benchmark")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from sgl_multilora.embedded import ensure_embedded_model

    machine = machine_info()
    model_path = ensure_embedded_model()
    handle = None
    if args.url:
        server = attach_server(args)
    else:
        handle, server = start_server(args, model_path)
    try:
        return soak(args, server, model_path, machine)
    finally:
        if handle is not None:
            if not handle.alive():
                print(f"server exited; log {handle.log_path}:\n{handle.log_tail()}", flush=True)
            handle.stop()


def write_records(path: Path, phase: int, records: list[RequestRecord],
                  admin: list[AdminRecord]) -> None:
    with open(path, "a") as f:
        f.writelines(json.dumps({"phase": phase, "type": type(rec).__name__, **asdict(rec)}) + "\n"
                     for rec in [*records, *admin])


def python_name() -> str:
    """The interpreter as a reader would type it: relative to the checkout when it is its venv."""
    path = Path(sys.executable)
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name


def run_info(args: argparse.Namespace, server: Server, machine: dict, num_phases: int,
             phase_s: float, adapter_names: list[str]) -> dict:
    """What every JSON line carries: date, command, machine, server and setup."""
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join([python_name(), "-m", "eval.bench.soak", *sys.argv[1:]]),
        "machine": machine, "server": server.description,
        "setup": {"minutes": args.minutes, "num_phases": num_phases, "phase_s": round(phase_s, 1),
                  "concurrency": args.concurrency, "seed": args.seed, "url": server.url,
                  "max_total_tokens": None if args.url else args.max_total_tokens,
                  "request_timeout_s": args.request_timeout_s, "sglang": version("sglang"),
                  "adapters": adapter_names},
    }


def soak(args: argparse.Namespace, server: Server, model_path: Path, machine: dict) -> int:
    """Runs every phase, writes the results, prints the verdicts; returns the exit code."""
    from transformers import AutoTokenizer

    num_phases = max(2, round(args.minutes / args.phase_minutes))
    phase_s = args.minutes * 60 / num_phases
    adapters = find_adapters(args.adapters_dir)
    _, _, memory = wait_idle(server.url, args.idle_timeout_s)
    adapter_bytes, adapter_names = adapter_state(memory)
    baseline = {"adapter_bytes": adapter_bytes, "adapter_names": adapter_names}
    run = {**run_info(args, server, machine, num_phases, phase_s, [a.name for a in adapters]),
           "baseline": baseline}
    jsonl, md = args.out.with_suffix(".jsonl"), args.out.with_suffix(".md")
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    if args.records:
        args.records.write_text("")
    client = Client(server.url, time.monotonic(), args.request_timeout_s)
    phases, stopped_early = [], None
    with tempfile.TemporaryDirectory(prefix="soak_adapters_") as workdir, open(jsonl, "w") as out:
        churn = Churn(client, adapters, Path(workdir), args.seed)
        prompts = Prompts(AutoTokenizer.from_pretrained(model_path))
        planner = Planner(prompts, adapters, churn.targets, args.seed)
        print(f"{num_phases} phases of {phase_s:.0f} s against {server.url}", flush=True)
        for phase in range(1, num_phases + 1):
            client.admin = []
            start = time.monotonic()
            records = run_phase(client, planner, churn, phase_s, args.concurrency, server.alive)
            duration = time.monotonic() - start
            check = check_server(server, churn, args.idle_timeout_s)
            summary = summarize_phase(phase, duration, records, client.admin, check)
            if args.records:
                write_records(args.records, phase, records, client.admin)
            phases.append(summary)
            out.write(json.dumps({"record": "phase", "run": run, **summary}) + "\n")
            out.flush()
            print(progress_line(summary, num_phases), flush=True)
            if not check.alive:
                stopped_early = f"the server was down after phase {phase} of {num_phases}"
                break
        machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        verdicts = criteria(phases, baseline, stopped_early)
        out.write(json.dumps({"record": "summary", "run": run,
                              "criteria": [vars(c) for c in verdicts]}) + "\n")
    md.write_text(render_markdown(run, phases, verdicts))
    for c in verdicts:
        print(f"  {'pass' if c.ok else 'FAIL'}  {c.name}: {c.detail}", flush=True)
    print(f"results: {jsonl}, {md}", flush=True)
    return 0 if all(c.ok for c in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())

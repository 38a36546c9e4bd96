"""The command line of `python -m sgl_multilora.cluster --workers N --router-port P --policy POLICY [-- <launch_server
args>]`: N plugin workers on ports P+1..P+N behind SGLang's router `smg` on port P, until Ctrl-C or SIGTERM; with
`--lora-server-adapter-dir DIR`, one LoRA server beside them that holds the adapters and computes their deltas, its
slots given or sized by InfiniLoRA's planner (`--lora-server-slots`, `sgl_multilora/planner.py`).

Lives here: argument checks and the run loop (restarting a worker that exits). Not here: starting and stopping the
processes (launch.py). `sgl_multilora/cluster/__main__.py` only calls `main`, so the command keeps the name users
know while the pure placement core imports nothing of the live gateway."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time

from sgl_multilora.gateway.launch import POLICIES, RESERVED_WORKER_FLAGS, Cluster, ClusterError
from sgl_multilora.lora_server.launch import LoRAServerProcess, LoRAServerStartError


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    own, worker_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(
        prog="python -m sgl_multilora.cluster",
        description="Start N SGLang workers (with the sgl_multilora plugin) behind the smg router. Everything "
                    "after `--` is passed to every `python -m sglang.launch_server` (--model-path included; "
                    "--host and --port are set per worker).",
        epilog="example: python -m sgl_multilora.cluster --workers 2 --router-port 30000 -- "
               "--model-path M --enable-lora --lora-paths caps=assets/adapters/caps --device cpu ...")
    parser.add_argument("--workers", type=int, required=True, help="number of workers")
    parser.add_argument("--router-port", type=int, default=30000,
                        help="the router's port; workers listen on the next N ports (default: 30000)")
    parser.add_argument("--policy", choices=POLICIES, default="lora_aware",
                        help="lora_aware (default): our adapter-aware placement in front of smg "
                             "(sgl_multilora/gateway/app.py); any other: that smg routing policy alone")
    parser.add_argument("--host", default="127.0.0.1", help="address the router and workers bind")
    parser.add_argument("--log-dir", default=None, help="worker<i>.log and router.log (default: a temp dir)")
    parser.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                        help="an extra `smg launch` argument (repeat, e.g. --router-arg=--cache-threshold "
                             "--router-arg=0.5)")
    parser.add_argument("--gateway-arg", action="append", default=[], metavar="ARG",
                        help="an extra argument of our gateway with lora_aware (repeat, e.g. --gateway-arg=--balancer "
                             "--gateway-arg=mell for MELL's live KV balancing, --gateway-arg=--migration "
                             "--gateway-arg=recompute)")
    parser.add_argument("--lora-server-adapter-dir", default=None, metavar="DIR",
                        help="start a LoRA server (python -m sgl_multilora.lora_server) holding the adapters in DIR "
                             "beside the workers: the workers get --multilora-lora-server and hold no adapter weights")
    parser.add_argument("--lora-server-arg", action="append", default=[], metavar="ARG",
                        help="an extra argument of the LoRA server (repeat, e.g. --lora-server-arg=--max-slots "
                             "--lora-server-arg=16)")
    parser.add_argument("--lora-server-slots", default=None, metavar="N|zipf:S|trace:FILE",
                        help="the LoRA server's adapter slots: N, or sized by InfiniLoRA's planner (the fewest "
                             "cached adapters whose immediate-admissibility rate reaches --lora-server-alpha) for "
                             "Zipf(S) popularity over the adapters in --lora-server-adapter-dir or for the adapters "
                             "of a request trace; the global batch is --workers x the workers' --max-running-requests")
    parser.add_argument("--lora-server-alpha", type=float, default=0.95,
                        help="with a planned --lora-server-slots: the share of requests whose adapter must be "
                             "admissible at once (default: 0.95)")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds a worker may take to start")
    parser.add_argument("--max-restarts", type=int, default=3,
                        help="times a worker that exits is started again before the cluster stops (default: 3; "
                             "with lora_aware its running requests continue on the other workers meanwhile)")
    args = parser.parse_args(own)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if not 0 < args.router_port <= 65535 - args.workers:
        parser.error(f"--router-port {args.router_port} leaves no room for {args.workers} worker ports above it")
    if "--model-path" not in worker_args:
        parser.error("pass the worker flags after `--`, including --model-path")
    for flag in RESERVED_WORKER_FLAGS:
        if flag in worker_args:
            parser.error(f"{flag} is set per worker by the launcher; leave it out of the worker flags")
    if args.lora_server_adapter_dir is not None and "--multilora-lora-server" in worker_args:
        parser.error("--lora-server-adapter-dir starts a LoRA server and points the workers at it; leave "
                     "--multilora-lora-server out of the worker flags")
    args.planned = None
    if args.lora_server_slots is not None:
        if args.lora_server_adapter_dir is None:
            parser.error("--lora-server-slots sizes the LoRA server of --lora-server-adapter-dir; pass that too")
        if "--max-slots" in args.lora_server_arg:
            parser.error("--lora-server-slots sets the LoRA server's --max-slots; leave it out of --lora-server-arg")
        try:
            args.planned = plan_slots(args.lora_server_slots, args.lora_server_adapter_dir, args.workers,
                                      worker_args, args.lora_server_alpha)
        except ValueError as e:
            parser.error(f"--lora-server-slots {args.lora_server_slots!r}: {e}")
    return args, worker_args


def plan_slots(spec: str, adapter_dir: str, workers: int, worker_args: list[str], alpha: float) -> dict:
    """The LoRA server's slot count for `spec` ("N", "zipf:S" or "trace:FILE"; see --lora-server-slots) as
    {"slots", and for a planned count "iar", "tau", "global_batch", "adapters", "tau_convention"}. Raises ValueError
    naming what is missing or malformed."""
    if spec.isdigit():
        if int(spec) < 1:
            raise ValueError("needs at least 1 slot")
        return {"slots": int(spec)}
    from sgl_multilora import planner

    kind, _, value = spec.partition(":")
    if "--max-running-requests" not in worker_args:
        raise ValueError("a planned size needs the workers' --max-running-requests (the planner's batch B) after `--`")
    batch = int(worker_args[worker_args.index("--max-running-requests") + 1])
    if kind == "zipf":
        try:
            s = float(value)
        except ValueError:
            raise ValueError("expected zipf:S, e.g. zipf:1.2") from None
        names = [d for d in os.listdir(adapter_dir)
                 if os.path.isfile(os.path.join(adapter_dir, d, "adapter_config.json"))]
        if not names:
            raise ValueError(f"{adapter_dir} holds no adapter (no */adapter_config.json)")
        p = planner.zipf_popularity(len(names), s)
    elif kind == "trace":
        p, _names = planner.trace_popularity(value)
    else:
        raise ValueError("expected N, zipf:S or trace:FILE")
    r = planner.min_cached_adapters(p, batch * workers, alpha)
    return {"slots": r.min_cached_adapters, "iar": r.iar, "tau": r.tau, "global_batch": r.global_batch,
            "adapters": r.num_adapters, "tau_convention": r.tau_convention}


def start_lora_server(args: argparse.Namespace, worker_args: list[str], log_dir: str):
    """The LoRA server of `--lora-server-adapter-dir`, started and answering, on an ipc socket in `log_dir`."""
    model_path = worker_args[worker_args.index("--model-path") + 1]
    address = f"ipc://{os.path.abspath(log_dir)}/lora_server.sock"
    return LoRAServerProcess(args.lora_server_adapter_dir, model_path, address,
                             os.path.join(log_dir, "lora_server.log"), lora_server_args(args)).start()


def lora_server_args(args: argparse.Namespace) -> list[str]:
    """The LoRA server's extra arguments: --lora-server-arg, and --max-slots from --lora-server-slots."""
    planned = args.planned
    return [*args.lora_server_arg, *(["--max-slots", str(planned["slots"])] if planned else [])]


def main(argv: list[str] | None = None) -> int:
    args, worker_args = parse_args(sys.argv[1:] if argv is None else argv)

    def stop_on_signal(signum, frame):
        raise KeyboardInterrupt

    # SIGINT too: a shell starts background jobs with SIGINT ignored, and Python keeps that
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop_on_signal)
    lora_server = None
    log_dir = args.log_dir
    try:
        if args.lora_server_adapter_dir is not None:
            log_dir = log_dir or tempfile.mkdtemp(prefix="sgl_multilora_cluster_")
            os.makedirs(log_dir, exist_ok=True)
            planned = args.planned
            if planned and "iar" in planned:
                print(f"LoRA server slots: {planned['slots']} of {planned['adapters']} adapters, planned for a "
                      f"global batch of {planned['global_batch']:g} (IAR {planned['iar']:.3f} >= alpha "
                      f"{args.lora_server_alpha}; tau {planned['tau']}, {planned['tau_convention']})", flush=True)
            print(f"starting the LoRA server on {args.lora_server_adapter_dir} ...", flush=True)
            lora_server = start_lora_server(args, worker_args, log_dir)
            print(f"lora server  {lora_server.address}  (log {lora_server.log_path})", flush=True)
            worker_args = [*worker_args, "--multilora-lora-server", lora_server.address]
        return _run(args, worker_args, log_dir)
    except LoRAServerStartError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        if lora_server is not None:
            lora_server.stop()


def _run(args: argparse.Namespace, worker_args: list[str], log_dir: str | None) -> int:
    cluster = Cluster(args.workers, worker_args, policy=args.policy, router_port=args.router_port, host=args.host,
                      router_args=args.router_arg, log_dir=log_dir, ready_timeout_s=args.ready_timeout,
                      gateway_args=args.gateway_arg)
    try:
        print(f"starting {args.workers} workers (logs in {cluster.log_dir}) ...", flush=True)
        with cluster:
            if cluster.gateway is not None:
                print(f"serving {cluster.url}  (LoRA-aware placement; cluster view {cluster.url}/cluster/stats)")
            print(f"router  {cluster.router_url}  (policy {args.policy}, metrics {cluster.metrics_url})")
            for url in cluster.worker_urls:
                print(f"worker  {url}")
            if cluster.admin_key_file is not None:
                print(f"the workers' admin API key (for their admin routes and /cluster/migrate) is in "
                      f"{cluster.admin_key_file}")
            if cluster.api_key:
                print("every route but the probes wants the workers' --api-key (Authorization: Bearer <key>)")
            print("Ctrl-C stops the cluster", flush=True)
            restarts = [0] * len(cluster.workers)
            while True:
                time.sleep(1.0)
                exited = cluster.exited()
                if not exited:
                    continue
                handle = exited[0]
                print(f"error: {handle.url} exited with code {handle.process.returncode}; log {handle.log_path}:\n"
                      f"{handle.log_tail()}", file=sys.stderr, flush=True)
                if handle not in cluster.workers or restarts[cluster.workers.index(handle)] >= args.max_restarts:
                    return 1
                index = cluster.workers.index(handle)
                restarts[index] += 1
                print(f"restarting worker {index} ({restarts[index]} of {args.max_restarts})", flush=True)
                cluster.restart_worker(index)
                print(f"worker  {handle.url}  is back", flush=True)
    except ClusterError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stopped", flush=True)
        return 0


if __name__ == "__main__":
    sys.exit(main())

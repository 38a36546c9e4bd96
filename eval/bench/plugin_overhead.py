"""What the plugin costs on base-model traffic: one CPU server without it, with it, with its tree.
Lives here: the arms, their servers, bench_serving and py-spy runs. Not here: the tables and the
computed conclusion (`plugin_overhead_report.py`), LoRA traffic (eval/live/), the tree alone
(`tree_overhead.py`), the attention op alone (`cpu_extend.py`).

Arms, all `sgl_multilora.server.cpu_server_args()` on the embedded SmolLM2-135M in fp32, no adapter:
- `no-plugin`: `SGLANG_PLUGINS` set to a name no plugin has (SGLang reads it as an allow-list), so
  the same server runs without sgl_multilora: stock SGLang 0.5.23;
- `plugin`: the plugin with its default flags (SGLang's own prefix cache);
- `plugin+tree`: plus `--radix-cache-backend multilora`;
- `plugin+tree:stock-attention` (only when named in `--arms`): plus
  `--multilora-stock-baseline extend-attention`.

Workload: SGLang's own `python -m sglang.bench_serving --backend sglang --dataset-name random-ids`
(default: 16 prompts, input length 384, output length 24, 2 requests/s), read from its
`--output-file`. Repeat r uses seed `--seed` + r for every arm, so the arms of a repeat get the
same prompts. Each repeat runs every arm once, in round-robin order rotated by one per repeat, and
ratios pair each arm with the baseline of the same repeat. Besides bench_serving's figures, each
measurement records the CPU seconds every server process used during it.

Servers (`--servers`): `persistent` (default) starts every arm's server once and keeps them all up
(about 1.5 GB each), measuring one at a time; an idle server sleeps (`--sleep-on-idle`), and the
CPU the idle ones used during a measurement is recorded (`idle_servers_cpu_s`). The arms of a
repeat then run back to back, with no server start between them while the machine's load drifts.
`per-repeat` starts each arm's server for its measurement and stops it after (one server up at a
time; start-up effects sampled anew each repeat). Either way the prefix cache is flushed
(`/flush_cache`) before each measurement and after bench_serving's warm-up request
(`--flush-cache`). Before anything is timed, each server must show the arm it claims
(`/multilora/stats`: 404 without the plugin, the tree on or off with it) and answer a greedy
prompt exactly as the first arm did.

Output: each measurement is a JSON line (setup, machine with its load average at start and end,
date, measurements) appended to `--out`; the run's summary goes to the same name with `.md`
(`--summarize` rewrites it from the file's last run); server logs go to `<out>/logs/`.
`--py-spy DIR` profiles instead: one bench_serving run per arm with py-spy sampling every server
process; `DIR/profile.jsonl`, `DIR/profile.md`, raw stacks in `DIR/logs/`.

    .venv/bin/python -m eval.bench.plugin_overhead [--quick] [--repeats 3]
        [--servers persistent|per-repeat] [--py-spy DIR] [--summarize]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

from eval.bench.plugin_overhead_report import (
    BASELINE,
    ROLES,
    render_markdown,
    render_profile_markdown,
    round_order,
    summarize_stacks,
)

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "eval" / "results" / "plugin_overhead" / "plugin_overhead.jsonl"
QUICK_RESULTS = Path("/tmp/plugin_overhead_quick/plugin_overhead.jsonl")
NO_PLUGIN_NAME = (
    "no-such-plugin"  # SGLANG_PLUGINS allow-list entry that matches no installed plugin
)
PY_SPY_RATE_HZ = 100


@dataclass(frozen=True)
class Arm:
    """One server configuration. `plugin` / `tree`: what `/multilora/stats` must show before it
    is measured."""

    name: str
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    plugin: bool = True
    tree: bool = False


ARMS: dict[str, Arm] = {
    a.name: a
    for a in (
        Arm("no-plugin", env=(("SGLANG_PLUGINS", NO_PLUGIN_NAME),), plugin=False),
        Arm("plugin"),
        Arm("plugin+tree", ("--radix-cache-backend", "multilora"), tree=True),
        Arm(
            "plugin+tree:stock-attention",
            ("--radix-cache-backend", "multilora", "--multilora-stock-baseline", "extend-attention"),
            tree=True,
        ),
    )
}
DEFAULT_ARMS = ("no-plugin", "plugin", "plugin+tree")


def describe(arm: Arm) -> str:
    env = " ".join(f"{k}={v}" for k, v in arm.env)
    what = "stock SGLang (the plugin is not loaded)" if not arm.plugin else "the plugin loaded"
    parts = [
        what,
        f"env `{env}`" if env else "",
        f"flags `{shlex.join(arm.extra_args)}`" if arm.extra_args else "",
    ]
    return ", ".join(p for p in parts if p)


# ---- machine, servers, bench_serving ------------------------------------------------------------


def machine_info() -> dict:
    """What a record needs to be read later: cores, CPU model, versions, the checkout's commit."""
    cpu_model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = (
            subprocess.run(
                ["git", "-C", str(REPO), "describe", "--always", "--dirty"],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.TimeoutExpired):
        commit = None
    from importlib.metadata import version

    return {
        "nproc": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "cpu_model": cpu_model,
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "sglang": version("sglang"),
        "torch": version("torch"),
        "git_commit": commit,
    }


def _get(url: str, timeout_s: float = 30) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _post(url: str, body: dict | None = None, timeout_s: float = 300) -> tuple[int, bytes]:
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def flush_cache(url: str, timeout_s: float = 60) -> None:
    """SGLang's `/flush_cache` (refused while requests run: retried). Raises RuntimeError if it
    never succeeds."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, body = _post(url + "/flush_cache")
        if status == 200:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"/flush_cache at {url}: HTTP {status} {body[:200]!r}")
        time.sleep(1.0)


CHECK_PROMPT_IDS = [1, 504, 3575, 282, 4649, 314, 253, 1345, 30, 378, 3575, 282, 4649, 314]


def check_arm(arm: Arm, url: str) -> list[int]:
    """Asserts that the server at `url` is `arm` (plugin and tree on or off) and returns its greedy
    answer to a fixed prompt (16 tokens), which must be the same on every arm: the plugin does not
    change base outputs."""
    status, body = _get(url + "/multilora/stats")
    if not arm.plugin:
        assert status == 404, (
            f"{arm.name}: /multilora/stats answered {status}: the plugin is loaded"
        )
    else:
        assert status == 200, (
            f"{arm.name}: /multilora/stats answered {status}: the plugin is not loaded"
        )
        enabled = json.loads(body)["enabled"]
        assert enabled == arm.tree, f"{arm.name}: tree enabled={enabled}, expected {arm.tree}"
    body = {
        "input_ids": CHECK_PROMPT_IDS,
        "sampling_params": {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True},
    }
    status, out = _post(url + "/generate", body)
    assert status == 200, f"{arm.name}: /generate answered {status}: {out[:300]!r}"
    return json.loads(out)["output_ids"]


def bench_command(
    url: str, model: str, out_file: Path, args: argparse.Namespace, seed: int
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "sglang.bench_serving",
        "--backend",
        "sglang",
        "--base-url",
        url,
        "--model",
        model,
        "--tokenizer",
        model,
        "--dataset-name",
        "random-ids",
        "--num-prompts",
        str(args.num_prompts),
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--request-rate",
        str(args.request_rate),
        "--seed",
        str(seed),
        "--flush-cache",
        "--disable-tqdm",
        "--output-file",
        str(out_file),
    ]


def run_bench(command: list[str], out_file: Path, timeout_s: float = 1800) -> dict:
    """Runs bench_serving; returns its JSON result. Raises RuntimeError with the end of its output
    on failure."""
    out_file.unlink(missing_ok=True)
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0 or not out_file.is_file():
        raise RuntimeError(
            f"bench_serving failed ({done.returncode}): {(done.stdout + done.stderr)[-2000:]}"
        )
    return json.loads(out_file.read_text().strip().splitlines()[-1])


BENCH_FIELDS = (  # kept from bench_serving's result
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "mean_e2e_latency_ms",
    "output_throughput",
    "request_throughput",
    "duration",
    "completed",
    "total_input_tokens",
    "total_output_tokens",
    "max_concurrent_requests",
)


def cpu_seconds(launcher_pid: int) -> dict[str, float]:
    """User + system CPU seconds used so far by each process of a server, by role (the launcher is
    the HTTP and tokenizer process)."""
    import psutil

    root = psutil.Process(launcher_pid)
    used = dict.fromkeys(("scheduler", "detokenizer", "http", "other"), 0.0)
    for proc in [root, *root.children(recursive=True)]:
        try:
            times, command = proc.cpu_times(), " ".join(proc.cmdline())
        except psutil.Error:
            continue
        role = next(
            (r for r, _ in ROLES if r in command), "http" if proc.pid == launcher_pid else "other"
        )
        used[role] += times.user + times.system
    return used


# ---- the run ------------------------------------------------------------------------------------


class Run:
    """One benchmark run: starts the arms' servers, checks them, measures, builds records. `close`
    stops every server it started."""

    def __init__(self, args: argparse.Namespace, model: str, argv: list[str]):
        from sgl_multilora.server import cpu_server_args

        self.args, self.model = args, model
        self.server_args = cpu_server_args(args.max_total_tokens)
        self.servers: dict = {}  # arm name -> ServerHandle
        self.reference_output: list[int] | None = None
        self.log_dir = args.out.with_suffix("") / "logs"
        self.started = time.monotonic()
        run_id = uuid.uuid4().hex[:12]
        self.machine = machine_info()
        self.setup = {
            "run_id": run_id,
            "command": shlex.join(["python", "-m", "eval.bench.plugin_overhead", *argv]),
            "arms": list(args.arms),
            "arm_setup": {a: describe(ARMS[a]) for a in args.arms},
            "baseline": BASELINE,
            "repeats": args.repeats,
            "servers": args.servers,
            "quick": args.quick,
            "model": "embedded SmolLM2-135M-Instruct",
            "model_path": model,
            "server_args": self.server_args,
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "request_rate": args.request_rate,
            "first_seed": args.seed,
            "bench_serving": shlex.join(
                ["python", *bench_command("URL", "MODEL", Path("OUT.json"), args, args.seed)[1:]]
            ).replace(f"--seed {args.seed}", "--seed SEED+REPEAT"),
        }

    def log(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:6.0f} s] {message}", flush=True)

    def start(self, name: str):
        """Starts `name`'s server and checks it (`check_arm`: the same greedy answer as the first
        arm started)."""
        from sgl_multilora.server import launch

        arm = ARMS[name]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log(f"{name}: starting its server")
        handle = launch(
            self.model,
            [*self.server_args, *arm.extra_args],
            env=dict(arm.env),
            log_path=self.log_dir / f"server_{name.replace(':', '_')}.log",
        )
        self.servers[name] = handle
        output = check_arm(arm, handle.url)
        if self.reference_output is None:
            self.reference_output = output
        assert output == self.reference_output, (
            f"{name}: greedy output {output} differs from the first arm's {self.reference_output}"
        )
        return handle

    def stop(self, name: str) -> None:
        handle = self.servers.pop(name, None)
        if handle is not None:
            handle.stop()

    def close(self) -> None:
        for name in list(self.servers):
            self.stop(name)

    def measure(self, name: str, repeat: int) -> dict:
        """One bench_serving run against `name`'s server (started if not up), on a flushed cache."""
        handle = self.servers.get(name) or self.start(name)
        others = [h for n, h in self.servers.items() if n != name]
        flush_cache(handle.url)
        out_file = self.log_dir / f"bench_{self.setup['run_id']}.json"
        command = bench_command(
            handle.url, self.model, out_file, self.args, self.args.seed + repeat
        )
        load_start, date = os.getloadavg(), datetime.datetime.now(datetime.UTC)
        cpu_start = cpu_seconds(handle.process.pid)
        idle_start = sum(sum(cpu_seconds(h.process.pid).values()) for h in others)
        result = run_bench(command, out_file)
        cpu_end = cpu_seconds(handle.process.pid)
        idle_end = sum(sum(cpu_seconds(h.process.pid).values()) for h in others)
        load_end = os.getloadavg()
        out_file.unlink(missing_ok=True)
        cpu = {role: cpu_end[role] - cpu_start[role] for role in cpu_start}
        measurements = {k: result.get(k) for k in BENCH_FIELDS}
        measurements.update(
            scheduler_cpu_s=cpu["scheduler"],
            server_cpu_s=sum(cpu.values()),
            cpu_s_by_process=cpu,
            idle_servers_cpu_s=idle_end - idle_start if others else None,
        )
        return {
            "setup": {
                **self.setup,
                "arm": name,
                "repeat": repeat,
                "seed": self.args.seed + repeat,
                "bench_serving_command": shlex.join(command[1:]),
            },
            "machine": {
                **self.machine,
                "load_average_start": load_start,
                "load_average_end": load_end,
            },
            "date": date.isoformat(timespec="seconds"),
            "measurements": measurements,
        }


def run_timing(run: Run) -> list[dict]:
    """Every repeat runs every arm once (rotated order); each record is appended to `--out` as it
    is made."""
    args, records, durations = run.args, [], []
    total = args.repeats * len(args.arms)
    if args.servers == "persistent":
        for name in args.arms:
            run.start(name)
    for repeat in range(args.repeats):
        for name in round_order(args.arms, repeat):
            left = total - len(records)
            eta = (
                f"about {statistics.mean(durations) * left / 60:.0f} min left"
                if durations
                else "first"
            )
            run.log(
                f"repeat {repeat + 1}/{args.repeats}: {name} ({len(records) + 1}/{total}, {eta})"
            )
            started = time.monotonic()
            record = run.measure(name, repeat)
            if args.servers == "per-repeat":
                run.stop(name)
            durations.append(time.monotonic() - started)
            records.append(record)
            with open(args.out, "a") as f:
                f.write(json.dumps(record) + "\n")
            m = record["measurements"]
            run.log(
                f"  mean TTFT {m['mean_ttft_ms']:.0f} ms, TPOT {m['mean_tpot_ms']:.1f} ms, "
                f"{m['output_throughput']:.1f} tok/s, scheduler CPU {m['scheduler_cpu_s']:.1f} s, "
                f"load {record['machine']['load_average_end'][0]:.2f}"
            )
    return records


def run_profile(run: Run, profile_dir: Path) -> list[dict]:
    """One bench_serving run per arm with py-spy sampling every process of its server; no timing
    records (the sampler costs time). Writes `profile.jsonl` (records with `summarize_stacks`) and
    `profile.md` in `profile_dir`, the raw stacks in its `logs/`."""
    raw_dir = profile_dir / "logs"
    raw_dir.mkdir(parents=True, exist_ok=True)
    py_spy = Path(sys.executable).with_name("py-spy")
    if not py_spy.is_file():
        raise SystemExit(f"--py-spy needs py-spy next to {sys.executable}: pip install py-spy")
    records = []
    for name in run.args.arms:
        handle = run.start(name)
        raw_path = raw_dir / f"py_spy_{name.replace(':', '_').replace('+', '_')}.txt"
        spy = subprocess.Popen(
            [
                str(py_spy),
                "record",
                "--pid",
                str(handle.process.pid),
                "--subprocesses",
                "--format",
                "raw",
                "--rate",
                str(PY_SPY_RATE_HZ),
                "--nonblocking",
                "--output",
                str(raw_path),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        try:
            time.sleep(2.0)  # py-spy attaches
            record = run.measure(name, 0)
        finally:
            spy.send_signal(signal.SIGINT)  # py-spy writes its output and exits
            spy.wait(timeout=120)
            run.stop(name)
        # bench_serving's requests and its warm-up request ran while py-spy sampled
        record["setup"].update(
            py_spy={"rate_hz": PY_SPY_RATE_HZ, "raw": str(raw_path)},
            num_requests=run.args.num_prompts + 1,
        )
        record["profile"] = summarize_stacks(raw_path.read_text())
        records.append(record)
        with open(profile_dir / "profile.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        run.log(f"{name}: {json.dumps(record['profile'])}")
    markdown = render_profile_markdown(records)
    (profile_dir / "profile.md").write_text(markdown)
    print(markdown)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: 1 repeat of 6 prompts, output length 8, results in {QUICK_RESULTS}",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated, of {list(ARMS)}"
    )
    parser.add_argument(
        "--servers",
        choices=("persistent", "per-repeat"),
        default="persistent",
        help="keep every arm's server up for the whole run (default), or start each arm's "
        "server for its measurement and stop it after",
    )
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=384)
    parser.add_argument("--output-len", type=int, default=24)
    parser.add_argument("--request-rate", type=float, default=2.0)
    parser.add_argument(
        "--seed", type=int, default=1, help="bench_serving's seed in repeat 0 (+1 per repeat)"
    )
    parser.add_argument("--max-total-tokens", type=int, default=8192)
    parser.add_argument("--out", type=Path, help=f"JSON lines, appended (default {RESULTS})")
    parser.add_argument(
        "--py-spy", type=Path, metavar="DIR", help="profile each arm's server instead"
    )
    parser.add_argument(
        "--summarize",
        action="store_true",
        help="start nothing: rewrite the summary of the last run recorded in --out",
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown or BASELINE not in args.arms:
        parser.error(f"--arms: unknown {unknown} or no {BASELINE}; known: {list(ARMS)}")
    if args.quick:
        args.repeats, args.num_prompts, args.output_len = 1, 6, 8
    args.out = args.out or (QUICK_RESULTS if args.quick else RESULTS)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.summarize:
        write_summary(last_run(args.out), args.out)
        return 0

    from sgl_multilora.embedded import ensure_embedded_model

    run = Run(args, str(ensure_embedded_model()), argv)
    # SIGTERM ends the run like Ctrl-C: the servers it started are stopped (`run.close`)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        if args.py_spy:
            run_profile(run, args.py_spy)
            return 0
        records = run_timing(run)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not leave servers up
        run.close()
    write_summary(records, args.out)
    return 0


def last_run(path: Path) -> list[dict]:
    """The records of the last run in a JSON lines file (by `run_id`)."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        raise SystemExit(f"{path} holds no records")
    run_id = records[-1]["setup"]["run_id"]
    return [r for r in records if r["setup"]["run_id"] == run_id]


def write_summary(records: list[dict], out: Path) -> None:
    markdown = render_markdown(records)
    md_path = out.with_suffix(".md")
    md_path.write_text(markdown)
    print(markdown)
    print(
        f"{len(records)} records of run {records[0]['setup']['run_id']} in {out}; "
        f"summary in {md_path}"
    )


if __name__ == "__main__":
    sys.exit(main())

"""One command: generate a workload, replay it against each arm's server, repeatedly, write results, a report and
plots. Not here: how each arm starts (`arms.py`), the order of replays (`protocol.py`), the replay (`driver.py`) or
the tables (`report.py`).

    .venv/bin/python -m eval.live.harness --workload chatbot --arms ours,stock --out-dir eval/results/chatbot \
        --param num_conversations=8 --param mean_output_tokens=8 --time-scales 1,4 --repeats 3

Starts every arm's server once and keeps them all up for the whole run (the embedded model on CPU by default, or
`--config` / `--model --device cuda`; idle servers sleep), or uses `--url ARM=URL` for servers already running.
Then, for each of `--repeats` repeats (default 3) and each time scale (arrivals compressed by that factor: the
rate points of the TTFT-vs-rate plot), replays the workload on each arm in turn, the arm order rotated per repeat
(two arms: alternating; protocol.py), each replay on an emptied prefix cache (`--keep-cache` keeps it). Writes
`results.jsonl` (one line per request, as it finishes; `extra.repeat` and `extra.load_avg`, the load average when
its replay started), `report.md` (starting with the run's setup: machine, load, protocol; figures as median
(min-max) over repeats) and PNGs under --out-dir. `--bench-serving N` also runs SGLang's
`python -m sglang.bench_serving` with N prompts over the served LoRA adapters (`--lora-name`) on each arm after
each repeat. An unreachable server stops the run with its address; the results so far and the report are still
written.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

import requests
from tqdm import tqdm

from eval.live.arms import ExperimentConfig, load_config, start_arm
from eval.live.bench_serving import bench_serving_command, run_bench_serving
from eval.live.driver import ServedAdapter, ServerUnreachable, Target, replay, served_from_manifest
from eval.live.protocol import arm_order, load_average, schedule, setup_section
from eval.live.report import load_results, write_report
from eval.workloads import WORKLOADS, create_workload
from sgl_multilora.embedded import ensure_embedded_model


def parse_params(items: list[str]) -> dict[str, str]:
    params = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--param expects KEY=VALUE, got {item!r}")
        params[key] = value
    return params


def served_adapters(adapters_dir: str) -> list[ServedAdapter]:
    """The adapters a server started on `adapters_dir` has: from its manifest.json, else every sub-directory with
    an adapter_config.json as a standard LoRA."""
    manifest = Path(adapters_dir) / "manifest.json"
    if manifest.is_file():
        return served_from_manifest(json.loads(manifest.read_text()))
    return [
        ServedAdapter(d.name)
        for d in sorted(Path(adapters_dir).iterdir())
        if (d / "adapter_config.json").is_file()
    ]


def flush_cache(arm: str, url: str, bar) -> None:
    """Empties the server's prefix cache (SGLang's `/flush_cache`) so that a replay does not hit what the previous
    replay of the same workload cached. SGLang refuses while requests are in flight; then this retries for 60 s and
    says so if it still cannot. Raises ServerUnreachable when nothing answers at `url`."""
    deadline = time.time() + 60
    while True:
        try:
            response = requests.post(url + "/flush_cache", timeout=30)
            if response.status_code == 200:
                return
            problem = f"HTTP {response.status_code}: {response.text.strip()[:200]}"
        except requests.ConnectionError as e:
            raise ServerUnreachable(f"cannot reach the server for arm {arm!r} at {url}: {e}") from e
        except requests.RequestException as e:
            problem = str(e)
        if time.time() > deadline:
            bar.write(f"{arm}: could not flush the prefix cache at {url} ({problem}); "
                      "this replay may hit what earlier requests cached")
            return
        time.sleep(1.0)


def start_servers(stack: contextlib.ExitStack, config: ExperimentConfig, arms, log_dir: Path) -> dict[str, str]:
    """Each arm's address: its `url`, else a server started now and stopped when `stack` closes. Every server
    stays up for the whole run (they sleep when idle: arms.py). Raises ServerStartError from start_arm; the
    servers started before it are stopped when `stack` closes."""
    urls = {}
    for arm in arms:
        if arm.url:
            urls[arm.name] = arm.url
        else:
            server = start_arm(config, arm, log_dir)
            stack.callback(server.stop)
            urls[arm.name] = server.url
    return urls


def bench_serving_arm(args, config: ExperimentConfig, arm: str, url: str, served, bar) -> None:
    """One `sglang.bench_serving` run on `arm`, its summary appended to bench_serving_<arm>.jsonl."""
    out = args.out_dir / f"bench_serving_{arm.replace(':', '_')}.jsonl"
    names = [s.name for s in served if s.kind == "lora"]
    tokenizer = config.model or str(ensure_embedded_model())
    command = bench_serving_command(url, tokenizer, names, out, args.bench_serving, args.bench_rate,
                                    args.bench_input_len, args.bench_output_len, args.seed)
    bar.write(f"{arm}: sglang.bench_serving {' '.join(command[3:])}")
    try:
        summary = run_bench_serving(command, out)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        bar.write(f"{arm}: {e}")
    else:
        bar.write(f"{arm}: bench_serving mean TTFT {summary.get('mean_ttft_ms')} ms")


def run_all(args, config: ExperimentConfig, urls: dict[str, str], workload, served, results_path: Path, bar):
    """Every replay of `schedule(...)` in order, each on a flushed cache (unless --keep-cache), its records tagged
    with the repeat and the load average at its start; after each repeat's replays, bench_serving on each arm (in
    that repeat's order) when asked. Raises ServerUnreachable from the driver."""
    plan = schedule(list(urls), args.repeats, args.time_scales)
    for i, step in enumerate(plan):
        bar.set_postfix_str(f"rep {step.repeat} x{step.time_scale:g} {step.arm}")
        url = urls[step.arm]
        if not args.keep_cache:
            flush_cache(step.arm, url, bar)
        replay(
            workload,
            [Target(step.arm, url)],
            results_path,
            args.experiment or workload.name,
            served,
            time_scale=step.time_scale,
            timeout_s=args.timeout_s,
            on_result=lambda _: bar.update(1),
            tags={"repeat": step.repeat, "load_avg": list(load_average())},
        )
        repeat_done = i + 1 == len(plan) or plan[i + 1].repeat != step.repeat
        if args.bench_serving and repeat_done:
            for arm in arm_order(list(urls), step.repeat):
                if not args.keep_cache:
                    flush_cache(arm, urls[arm], bar)
                bench_serving_arm(args, config, arm, urls[arm], served, bar)


def set_aside(path: Path) -> None:
    """A new run starts new files; the previous one is kept beside it as <name>.prev."""
    if path.exists():
        path.replace(path.with_name(path.name + ".prev"))
        print(f"moved the previous {path} to {path.name}.prev")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", required=True, choices=list(WORKLOADS))
    parser.add_argument(
        "--param", action="append", default=[], help="workload parameter KEY=VALUE (repeatable)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--arms",
        default=None,
        help="comma-separated arm names (default: ours,stock or the config's)",
    )
    parser.add_argument(
        "--config", type=Path, help="JSON experiment config (model, device, arms; eval/live/arms.py)"
    )
    parser.add_argument(
        "--url", action="append", default=[], help="ARM=URL: use a running server for ARM"
    )
    parser.add_argument(
        "--served-adapters",
        help="comma-separated: map the workload's adapters onto only these of the served ones",
    )
    parser.add_argument("--model", help="model path (default: the embedded SmolLM2-135M)")
    parser.add_argument("--device", default=None, help="cpu (default) or cuda")
    parser.add_argument(
        "--time-scales", default="1", help="comma-separated arrival compressions, one replay each"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="replays of every (arm, time scale), arms interleaved"
    )
    parser.add_argument(
        "--experiment", help="experiment name in the records (default: the workload's)"
    )
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per-request timeout")
    parser.add_argument(
        "--keep-cache",
        action="store_true",
        help="do not flush each server's prefix cache before each replay (default: flush)",
    )
    parser.add_argument("--slo-s", type=float, default=0.5, help="TTFT SLO for the peak load")
    parser.add_argument("--baselines", default="stock")
    parser.add_argument(
        "--bench-serving",
        type=int,
        default=0,
        metavar="N",
        help="also run bench_serving, N prompts",
    )
    parser.add_argument("--bench-rate", type=float, default=1.0)
    parser.add_argument("--bench-input-len", type=int, default=128)
    parser.add_argument("--bench-output-len", type=int, default=16)
    started = datetime.datetime.now(datetime.UTC)
    load_start = load_average()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.time_scales = [float(x) for x in args.time_scales.split(",")]
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {args.repeats}")

    arm_names = [a for a in args.arms.split(",") if a] if args.arms else None
    try:
        config = load_config(args.config, arm_names)
        workload = create_workload(args.workload, seed=args.seed, **parse_params(args.param))
    except (
        OSError,
        ValueError,
    ) as e:  # a bad config, parameter or trace file: say which, no traceback
        raise SystemExit(f"error: {e}") from e
    overrides = {k: v for k, v in (("model", args.model), ("device", args.device)) if v}
    config = dataclasses.replace(config, **overrides)
    urls = dict(item.split("=", 1) for item in args.url if "=" in item)
    unknown = [
        item for item in args.url if item.split("=", 1)[0] not in {a.name for a in config.arms}
    ]
    if unknown or len(urls) != len(args.url):
        raise SystemExit(f"--url expects ARM=URL for an arm of this run, got {unknown or args.url}")
    arms = [dataclasses.replace(a, url=urls[a.name]) if a.name in urls else a for a in config.arms]
    served = served_adapters(config.adapters_dir)
    if args.served_adapters:
        names = args.served_adapters.split(",")
        unknown = sorted(set(names) - {s.name for s in served})
        if unknown:
            raise SystemExit(f"--served-adapters: {unknown} not in {[s.name for s in served]}")
        served = [s for s in served if s.name in names]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results_path = args.out_dir / "results.jsonl"
    for path in [results_path, *args.out_dir.glob("bench_serving_*.jsonl")]:
        set_aside(path)
    (args.out_dir / "workload.json").write_text(
        json.dumps(
            {
                "name": workload.name,
                "seed": workload.seed,
                "params": workload.params,
                "num_requests": len(workload.requests),
                "offered_rate": workload.offered_rate,
                "notes": workload.notes,
            },
            default=str,
        )
    )
    total = len(workload.requests) * len(args.time_scales) * len(arms) * args.repeats
    status = 0
    with (
        contextlib.ExitStack() as servers,
        tqdm(total=total, desc=f"{workload.name} x {len(arms)} arms x {args.repeats}", unit="req") as bar,
    ):
        arm_urls = start_servers(servers, config, arms, args.out_dir / "logs")
        try:
            run_all(args, config, arm_urls, workload, served, results_path, bar)
        except ServerUnreachable as e:
            bar.write(f"error: {e}")
            status = 1
        load_end = load_average()  # before the servers stop
    records = load_results([results_path]) if results_path.is_file() else []
    if records:
        protocol = {"num_repeats": args.repeats, "time_scales": args.time_scales, "keep_cache": args.keep_cache,
                    "load_start": load_start, "load_end": load_end}
        md, pngs = write_report(
            records,
            args.out_dir,
            args.baselines.split(","),
            args.slo_s,
            title=f"{workload.name} (seed {workload.seed})",
            setup=setup_section(argv, config, arms, workload, started, protocol, records),
        )
        print(md.read_text())
        print("wrote", results_path, md, *pngs)
    return status


if __name__ == "__main__":
    sys.exit(main())

"""One command: generate a workload, replay it against each arm's server, write results, a report and plots.
Not here: how each arm starts (`arms.py`), the replay (`driver.py`) or the tables (`report.py`).

    .venv/bin/python -m eval.live.harness --workload chatbot --arms ours,stock --out-dir eval/results/chatbot \
        --param num_conversations=8 --param mean_output_tokens=8 --time-scales 1,4

Starts each arm's server in turn (the embedded model on CPU by default, or `--config` / `--model --device cuda`),
or uses `--url ARM=URL` for servers already running; replays the workload once per time scale (arrivals compressed
by that factor: the rate points of the TTFT-vs-rate plot), each on an emptied prefix cache (`--keep-cache` keeps
it); writes `results.jsonl` (one line per request, as it finishes), `report.md` (starting with the run's setup) and
PNGs under --out-dir. `--bench-serving N` also runs SGLang's
`python -m sglang.bench_serving` with N prompts over the served LoRA adapters (`--lora-name`) on each arm.
An unreachable server stops the run with its address; the results so far and the report are still written.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

import requests
from tqdm import tqdm

from eval.live.arms import (
    ExperimentConfig,
    bench_serving_command,
    load_config,
    run_bench_serving,
    server_args,
    start_arm,
)
from eval.live.driver import ServedAdapter, ServerUnreachable, Target, replay, served_from_manifest
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


BENCH_FIELDS = (
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "output_throughput",
)


def bench_serving_table(out_dir: Path) -> str:
    """A Markdown table of the bench_serving_<arm>.jsonl files in out_dir (their last line), or ""."""
    files = sorted(out_dir.glob("bench_serving_*.jsonl"))
    if not files:
        return ""
    lines = [
        "",
        "`python -m sglang.bench_serving` (random ids, `--lora-name` over the served LoRAs):",
        "",
    ]
    lines += ["| arm | " + " | ".join(BENCH_FIELDS) + " |", "|---|" + "---:|" * len(BENCH_FIELDS)]
    for path in files:
        summary = json.loads(path.read_text().strip().splitlines()[-1])
        cells = [
            f"{summary[k]:.1f}" if isinstance(summary.get(k), float) else "-" for k in BENCH_FIELDS
        ]
        lines.append(f"| {path.stem.removeprefix('bench_serving_')} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def flush_cache(arm: str, url: str, bar) -> None:
    """Empties the server's prefix cache (SGLang's `/flush_cache`) so that a replay does not hit what the previous
    replay of the same workload cached. SGLang refuses while requests are in flight; then this retries for 60 s and
    says so if it still cannot."""
    deadline = time.time() + 60
    while True:
        try:
            response = requests.post(url + "/flush_cache", timeout=30)
            if response.status_code == 200:
                return
            problem = f"HTTP {response.status_code}: {response.text.strip()[:200]}"
        except requests.RequestException as e:
            problem = str(e)
        if time.time() > deadline:
            bar.write(f"{arm}: could not flush the prefix cache at {url} ({problem}); "
                      "this replay may hit what earlier requests cached")
            return
        time.sleep(1.0)


def run_arm(args, config: ExperimentConfig, arm, workload, served, results_path: Path, bar) -> None:
    server = None if arm.url else start_arm(config, arm, args.out_dir / "logs")
    url = arm.url or server.url
    try:
        for scale in args.time_scales:
            if not args.keep_cache:
                flush_cache(arm.name, url, bar)
            replay(
                workload,
                [Target(arm.name, url)],
                results_path,
                args.experiment or workload.name,
                served,
                time_scale=scale,
                timeout_s=args.timeout_s,
                on_result=lambda _: bar.update(1),
            )
        if args.bench_serving:
            out = args.out_dir / f"bench_serving_{arm.name.replace(':', '_')}.jsonl"
            names = [s.name for s in served if s.kind == "lora"]
            tokenizer = config.model or str(ensure_embedded_model())
            command = bench_serving_command(
                url,
                tokenizer,
                names,
                out,
                args.bench_serving,
                args.bench_rate,
                args.bench_input_len,
                args.bench_output_len,
                args.seed,
            )
            bar.write(f"{arm.name}: sglang.bench_serving {' '.join(command[3:])}")
            try:
                summary = run_bench_serving(command, out)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                bar.write(f"{arm.name}: {e}")
            else:
                bar.write(f"{arm.name}: bench_serving mean TTFT {summary.get('mean_ttft_ms')} ms")
    finally:
        if server is not None:
            server.stop()


def setup_section(argv: list[str], config: ExperimentConfig, arms, workload, started: datetime.datetime) -> str:
    """The run's setup for the report: command, start date, machine, model, each arm's server flags, workload."""
    import os
    import platform
    import shlex

    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    lines = [
        f"- command: `{shlex.join(['python', '-m', 'eval.live.harness', *argv])}`",
        f"- started: {started.strftime('%Y-%m-%d %H:%M UTC')}",
        f"- machine: {platform.machine()}, {os.cpu_count()} CPU cores, GPU: {gpu}; device {config.device}",
        f"- model: {config.model or 'embedded SmolLM2-135M-Instruct'}; adapters: {config.adapters_dir}",
    ]
    for arm in arms:
        if arm.url:
            lines.append(f"- arm `{arm.name}` ({arm.kind}): running server at {arm.url}")
        else:
            flags, env = server_args(config, arm)
            env_text = " ".join(f"{k}={v}" for k, v in env.items())
            lines.append(f"- arm `{arm.name}` ({arm.kind}): `{(env_text + ' ') if env_text else ''}"
                         f"launch_server {shlex.join(flags)}`")
    params = ", ".join(f"{k}={v}" for k, v in workload.params.items())
    lines.append(f"- workload: {workload.name}, seed {workload.seed}, {len(workload.requests)} requests; {params}")
    return "Setup:\n\n" + "\n".join(lines) + "\n"


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
        "--time-scales", default="1", help="comma-separated arrival compressions, one run each"
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
    started = datetime.datetime.now(datetime.timezone.utc)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.time_scales = [float(x) for x in args.time_scales.split(",")]

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
    if results_path.exists():  # a new run starts a new file; the previous one is kept beside it
        results_path.replace(results_path.with_suffix(".jsonl.prev"))
        print(f"moved the previous {results_path} to {results_path.with_suffix('.jsonl.prev')}")
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
    total = len(workload.requests) * len(args.time_scales) * len(arms)
    status = 0
    with tqdm(total=total, desc=f"{workload.name} x {len(arms)} arms", unit="req") as bar:
        for arm in arms:
            bar.set_postfix_str(arm.name)
            try:
                run_arm(args, config, arm, workload, served, results_path, bar)
            except ServerUnreachable as e:
                bar.write(f"error: {e}")
                status = 1
                break
    records = load_results([results_path]) if results_path.is_file() else []
    if records:
        md, pngs = write_report(
            records,
            args.out_dir,
            args.baselines.split(","),
            args.slo_s,
            title=f"{workload.name} (seed {workload.seed})",
            setup=setup_section(argv, config, arms, workload, started),
        )
        bench = bench_serving_table(args.out_dir)
        if bench:
            md.write_text(md.read_text() + bench)
        print(md.read_text())
        print("wrote", results_path, md, *pngs)
    return status


if __name__ == "__main__":
    sys.exit(main())

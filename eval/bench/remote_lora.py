"""Remote LoRA against in-process LoRA, per decode step: a worker whose deltas a LoRA server computes
(`--multilora-lora-server`) against the same worker build holding the adapters itself, on the dense embedded model
and on its 4-expert MoE variant.

Arms, all up at once and measured interleaved (the order alternates per repeat): `inproc` (one worker with
`--multilora-adapter-dir`: adapters in its process) and `remote` (one worker with `--multilora-lora-server` plus one
LoRA server holding the same adapters, `--max-slots` all of them). Both workers are CPU servers of one build
(`cpu_server_args`); the LoRA server shares the machine's cores with them, as a co-located server would.

The decode step time of one arm at k adapters: a batch of BATCH concurrent requests (short distinct prompts, the
adapters cycled over them, greedy, eos ignored) run once with LONG and once with SHORT new tokens; the step time is
(T_long - T_short) / (LONG - SHORT), so prefill and HTTP costs cancel. Base steps (no adapter) are measured on the
in-process worker alike. The remote worker's counters (`/multilora/stats` "lora_server") give the seconds its
forward waited on replies after its own base GEMMs: the part of the round trip that did not hide. The process trees'
RSS after the run says what the adapters cost each worker.

With `--memory-counts 0,8,16,32`, it measures instead each worker's RSS as adapters are added (`memory_curve`).

Usage: .venv/bin/python -m eval.bench.remote_lora [--models dense,moe] [--repeats 3] [--adapters 1,4,8]
       [--out eval/results/remote_lora/remote_lora.jsonl] [--memory-counts 0,8,16,32]
The .jsonl keeps the latest step run and the latest memory run; the .md beside it reports both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from eval.bench.results import run_record
from eval.bench.soak import process_tree_rss
from sgl_multilora.lora_server.launch import LoRAServerProcess
from sgl_multilora.server import cpu_server_args, launch

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "remote_lora_adapters"
BATCH = 8
SHORT, LONG = 4, 36
RANKS = (8, 16, 32, 8, 16, 32, 8, 16)
DENSE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_path: str, kind: str, count: int, experts_only: bool = False) -> Path:
    """`count` random PEFT adapters (seeded, reused when present) in CACHE/`kind`: on every projection for the dense
    model; on the fused experts and q/v for the MoE model; with `experts_only`, rank 8 on the fused experts alone."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = CACHE / kind
    names = [f"{kind}-{i:02d}" for i in range(count)]
    if all((out / n / "adapter_config.json").exists() for n in names):
        return out
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    for i, name in enumerate(names):
        torch.manual_seed(7000 + i)
        rank = 8 if experts_only else RANKS[i % len(RANKS)]
        if experts_only:
            config = LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False, task_type="CAUSAL_LM",
                                target_modules=[], target_parameters=experts)
        elif kind == "moe":
            config = LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False, task_type="CAUSAL_LM",
                                target_modules=["q_proj", "v_proj"], target_parameters=experts)
        else:
            config = LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False, task_type="CAUSAL_LM",
                                target_modules=DENSE_TARGETS)
        model = get_peft_model(base, config)
        model.save_pretrained(str(out / name))
        base = model.unload()
    return out


def batch_seconds(url: str, names: list[str | None], new_tokens: int, seed: int) -> float:
    def one(i: int) -> None:
        ids = [1000 + (seed * 97 + i * 13 + j * 7) % 40000 for j in range(24)]
        body = {"input_ids": ids, "lora_path": names[i % len(names)],
                "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}
        res = requests.post(url + "/generate", json=body, timeout=900)
        res.raise_for_status()

    start = time.perf_counter()
    with ThreadPoolExecutor(BATCH) as pool:
        list(pool.map(one, range(BATCH)))
    return time.perf_counter() - start


def step_seconds(url: str, names: list[str | None], seed: int) -> float:
    short = batch_seconds(url, names, SHORT, seed)
    long = batch_seconds(url, names, LONG, seed + 1)
    return (long - short) / (LONG - SHORT)


def remote_counters(url: str) -> dict:
    state = requests.get(url + "/multilora/stats", timeout=60).json().get("lora_server") or [{}]
    return state[0] or {}


def run_model(kind: str, model_path: str, repeats: int, counts: list[int], log_dir: Path) -> list[dict]:
    adapter_dir = make_adapters(model_path, kind, max(counts))
    names = sorted(p.name for p in adapter_dir.iterdir() if (p / "adapter_config.json").exists())[:max(counts)]
    address = f"ipc://{log_dir}/remote_lora_{kind}.sock"
    lora_srv = LoRAServerProcess(adapter_dir, model_path, address, log_dir / f"remote_lora_{kind}_srv.log",
                                 ["--max-slots", "8"]).start()
    common = [*cpu_server_args(max_total_tokens=4096), "--max-loras-per-batch", "8"]
    servers = {}
    try:
        servers["inproc"] = launch(model_path, [*common, "--multilora-adapter-dir", str(adapter_dir),
                                                "--max-lora-rank", "32"],
                                   log_path=log_dir / f"remote_lora_{kind}_inproc.log")
        servers["remote"] = launch(model_path, [*common, "--multilora-lora-server", address],
                                   log_path=log_dir / f"remote_lora_{kind}_remote.log")
        for arm, server in servers.items():  # warm-up: every adapter once (the remote one learns them by name)
            for name in names:
                batch_seconds(server.url, [name], 2, 0)
        rows = []
        for rep in range(repeats):
            order = ["inproc", "remote"] if rep % 2 == 0 else ["remote", "inproc"]
            rows.append({"model": kind, "repeat": rep, "adapters": 0, "arm": "base",
                         "step_s": step_seconds(servers["inproc"].url, [None], 100 * rep)})
            for k in counts:
                for arm in order:
                    before = remote_counters(servers[arm].url) if arm == "remote" else {}
                    step = step_seconds(servers[arm].url, names[:k], 100 * rep + k)
                    row = {"model": kind, "repeat": rep, "adapters": k, "arm": arm, "step_s": step}
                    if arm == "remote":
                        after = remote_counters(servers[arm].url)
                        row["wait_s"] = after.get("wait_s", 0) - before.get("wait_s", 0)
                        row["calls"] = after.get("calls", 0) - before.get("calls", 0)
                    rows.append(row)
                    print(f"{kind} rep {rep} k={k} {arm}: {step * 1e3:.1f} ms/step", flush=True)
        rss = {arm: process_tree_rss(s.process.pid)[0] for arm, s in servers.items()}
        rss["lora_server"] = process_tree_rss(lora_srv.process.pid)[0]
        rows.append({"model": kind, "rss_bytes": rss, "adapter_bytes": sum(
            (adapter_dir / n / "adapter_model.safetensors").stat().st_size for n in names)})
        return rows
    finally:
        for server in servers.values():
            server.stop()
        lora_srv.stop()


def memory_curve(kind: str, model_path: str, counts: list[int], log_dir: Path) -> list[dict]:
    """Worker RSS as adapters are added: one remote worker (its LoRA server holding all max(counts) adapters) and one
    in-process worker that loads each adapter on its first request (`--multilora-adapter-source`, no host budget).
    After each count k, every adapter below k has served one request on both workers; rows hold the process trees'
    RSS then (the LoRA server's too)."""
    adapter_dir = make_adapters(model_path, kind, max(counts))
    names = sorted(p.name for p in adapter_dir.iterdir() if (p / "adapter_config.json").exists())[:max(counts)]
    address = f"ipc://{log_dir}/remote_memory_{kind}.sock"
    lora_srv = LoRAServerProcess(adapter_dir, model_path, address, log_dir / f"remote_memory_{kind}_srv.log",
                                 ["--max-slots", "8"]).start()
    common = [*cpu_server_args(max_total_tokens=4096), "--max-loras-per-batch", "8"]
    servers = {}
    try:
        servers["inproc"] = launch(model_path, [*common, "--multilora-adapter-source", str(adapter_dir),
                                                "--max-lora-rank", "32", "--lora-target-modules", "all"],
                                   log_path=log_dir / f"remote_memory_{kind}_inproc.log")
        servers["remote"] = launch(model_path, [*common, "--multilora-lora-server", address],
                                   log_path=log_dir / f"remote_memory_{kind}_remote.log")
        for server in servers.values():  # the base path warmed alike before the first reading
            batch_seconds(server.url, [None], 2, 0)
        rows, done = [], 0
        for k in sorted(counts):
            for name in names[done:k]:
                for server in servers.values():
                    batch_seconds(server.url, [name], 2, 0)
            done = k
            time.sleep(1.0)
            rss = {arm: process_tree_rss(s.process.pid)[0] for arm, s in servers.items()}
            rss["lora_server"] = process_tree_rss(lora_srv.process.pid)[0]
            files = sum((adapter_dir / n / "adapter_model.safetensors").stat().st_size for n in names[:k])
            rows.append({"model": kind, "adapters": k, "rss_bytes": rss, "adapter_bytes": files})
            print(f"{kind} {k} adapters: " + ", ".join(f"{a} {b / 1e9:.2f} GB" for a, b in rss.items()), flush=True)
        return rows
    finally:
        for server in servers.values():
            server.stop()
        lora_srv.stop()


def memory_report(record: dict) -> str:
    lines = ["## Worker memory as adapters are added", "",
             f"{record['date']}, {record['device']['cpu_count']} CPUs. After k adapters have each served one request "
             "on both workers: the process tree's RSS of the in-process worker (adapters loaded on first request, "
             "no host budget), of the remote worker (`--multilora-lora-server`) and of the LoRA server (holding every "
             "adapter from its start). Growth is against k = 0.", "",
             "| model | adapters | adapters' files MB | in-process GB (growth) | remote GB (growth) | LoRA server GB |",
             "|---|---:|---:|---|---|---:|"]
    rows = record["rows"]
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = sorted((r for r in rows if r["model"] == model), key=lambda r: r["adapters"])
        zero = mine[0]["rss_bytes"]
        for r in mine:
            g = {a: (r["rss_bytes"][a] - zero[a]) / 1e9 for a in ("inproc", "remote")}
            lines.append(f"| {model} | {r['adapters']} | {r['adapter_bytes'] / 1e6:.0f} | "
                         f"{r['rss_bytes']['inproc'] / 1e9:.2f} ({g['inproc']:+.2f}) | "
                         f"{r['rss_bytes']['remote'] / 1e9:.2f} ({g['remote']:+.2f}) | "
                         f"{r['rss_bytes']['lora_server'] / 1e9:.2f} |")
    return "\n".join(lines) + "\n"


def report(record: dict) -> str:
    lines = ["# Remote LoRA against in-process LoRA, per decode step", "",
             f"{record['date']}, {record['device']['cpu_count']} CPUs, load {record['device']['load_avg_start']} at "
             f"the start; batch {BATCH}, step = (T({LONG}) - T({SHORT})) / {LONG - SHORT} new tokens; "
             f"{record['setup']['repeats']} repeats, arms interleaved; median (min-max) over repeats.", "",
             "| model | adapters | in-process ms/step | remote ms/step | remote / in-process | waited on replies "
             "(share of the remote step) |", "|---|---|---|---|---|---|"]
    rows = [r for r in record["rows"] if "step_s" in r]
    for model in dict.fromkeys(r["model"] for r in rows):
        base = [r["step_s"] for r in rows if r["model"] == model and r["arm"] == "base"]
        lines.append(f"| {model} | base | {_med(base, 1e3)} | | | |")
        for k in sorted({r["adapters"] for r in rows if r["model"] == model and r["adapters"]}):
            by_rep = {}
            for r in rows:
                if r["model"] == model and r["adapters"] == k:
                    by_rep.setdefault(r["repeat"], {})[r["arm"]] = r
            ratios = [v["remote"]["step_s"] / v["inproc"]["step_s"] for v in by_rep.values()]
            waits = [v["remote"]["wait_s"] / (v["remote"]["step_s"] * (LONG + SHORT)) for v in by_rep.values()]
            lines.append(f"| {model} | {k} | {_med([v['inproc']['step_s'] for v in by_rep.values()], 1e3)} | "
                         f"{_med([v['remote']['step_s'] for v in by_rep.values()], 1e3)} | {_med(ratios, 1, 'x')} | "
                         f"{_med(waits, 100, '%')} |")
    for r in record["rows"]:
        if "rss_bytes" in r:
            rss = ", ".join(f"{arm} {b / 1e9:.2f} GB" for arm, b in r["rss_bytes"].items())
            lines.append(f"\nRSS after the run ({r['model']}, adapters' files {r['adapter_bytes'] / 1e6:.0f} MB): {rss}.")
    lines.append("\nWaited on replies: the remote worker's seconds blocked on the LoRA server after its base GEMM, over "
                 "both batches of a measurement, divided by the remote step time times the tokens decoded per request "
                 "(an estimate of the share of a step spent waiting).")
    return "\n".join(lines) + "\n"


def _med(values: list[float], scale: float, unit: str = "") -> str:
    if not values:
        return "-"
    xs = [v * scale for v in values]
    fmt = ".2f" if unit == "x" else ".1f"
    return f"{statistics.median(xs):{fmt}}{unit} ({min(xs):{fmt}}-{max(xs):{fmt}})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="dense,moe")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--adapters", default="1,4,8")
    parser.add_argument("--out", type=Path, default=REPO / "eval/results/remote_lora/remote_lora.jsonl")
    parser.add_argument("--memory-counts", default="",
                        help="instead of step times: worker RSS after this many adapters served (e.g. 0,8,16,32); "
                             "kept in --out beside the latest step run")
    args = parser.parse_args()
    from sgl_multilora.embedded import ensure_embedded_model
    from sgl_multilora.embedded_moe import ensure_embedded_moe_model

    paths = {"dense": str(ensure_embedded_model()), "moe": str(ensure_embedded_moe_model())}
    counts = [int(k) for k in args.adapters.split(",")]
    log_dir = REPO / ".cache" / "remote_lora_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    load = list(os.getloadavg())
    rows = []
    if args.memory_counts:
        mem_counts = [int(k) for k in args.memory_counts.split(",")]
        for kind in args.models.split(","):
            rows += memory_curve(kind, paths[kind], mem_counts, log_dir)
        save_latest(args.out, run_record({"kind": "memory", "counts": mem_counts}, rows, load))
        return
    for kind in args.models.split(","):
        rows += run_model(kind, paths[kind], args.repeats, counts, log_dir)
    setup = {"kind": "step", "repeats": args.repeats, "adapters": counts, "batch": BATCH, "short": SHORT,
             "long": LONG, "ranks": RANKS[:max(counts)], "server": cpu_server_args(4096)}
    save_latest(args.out, run_record(setup, rows, load))


def save_latest(out: Path, record: dict) -> None:
    """Keeps one record per kind in `out` (the step run and the memory run; earlier runs live in git), the new one
    replacing its kind's, and writes both reports to the .md beside it."""
    kinds = {}
    if out.exists():
        for line in out.read_text().splitlines():
            old = json.loads(line)
            kinds[old["setup"].get("kind", "step")] = old
    kinds[record["setup"]["kind"]] = record
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(kinds[k]) + "\n" for k in ("step", "memory") if k in kinds))
    text = "\n".join(f(kinds[k]) for k, f in (("step", report), ("memory", memory_report)) if k in kinds)
    print(text)
    out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()

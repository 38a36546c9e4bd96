"""InfiniLoRA's headline on this machine: N workers with one LoRA server against N coupled workers offered the same
total memory, on the MoE model with more expert adapters than one worker's share of memory holds.

Fixed before any run (the rule, not tuned on results):
- Model: the embedded 4-expert MoE model. Adapters: NUM_ADAPTERS random PEFT adapters on the fused experts (rank 8,
  fp32, each as large as ADAPTER_SLOTS token slots of KV), Zipf(1.2) popularity; each worker is pre-assigned a
  disjoint subset by greedy balancing of popularity (the paper's setup, both arms alike).
- Memory: a coupled worker gets the unified pool of COUPLED_SLOTS token slots (adapters and KV share it); a
  disaggregated worker gets KV_SLOTS for KV alone, and the LoRA server the rest of the same total as adapter slots:
  floor(N * (COUPLED_SLOTS - KV_SLOTS) / ADAPTER_SLOTS) adapters.
- Traffic: Poisson arrivals, PROMPT_TOKENS-token prompts of random ids, OUTPUT_TOKENS new tokens, greedy, at each
  total rate of --rates; both arms replay the same requests, repeats interleaved (arm order alternating).
- SLOs, scaled to this machine by one calibration before the runs (a single base request on a coupled worker, idle):
  TTFT (queueing + prefill + first token; no prefill/decode split here, unlike the paper's decode TTFT) P95 within
  TTFT_SLO_X x its TTFT, and mean TPOT within TPOT_SLO_X x its TPOT. Serviceable rate: the highest swept rate at which
  both hold (pooled over the arm's repeats at that rate); SLO attainment: the share of adapters whose requests meet
  both SLOs in more than 90% of cases, at each rate.

Usage: .venv/bin/python -m eval.bench.remote_serviceable [--rates 0.3,0.6,0.9] [--repeats 2] [--requests 30]
       [--out eval/results/remote_lora/remote_serviceable.jsonl]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import requests

from eval.bench.remote_lora import make_adapters
from eval.bench.results import nearest_rank, run_record, save
from eval.live.driver import ServedAdapter, Target, replay
from eval.workloads import Workload
from eval.workloads.records import AdapterInfo, Request
from sgl_multilora.lora_server.launch import LoRAServerProcess
from sgl_multilora.server import cpu_server_args, launch

REPO = Path(__file__).resolve().parents[2]
NUM_WORKERS, NUM_ADAPTERS, ZIPF_S = 2, 16, 1.2
COUPLED_SLOTS, KV_SLOTS = 4000, 1600
PROMPT_TOKENS, OUTPUT_TOKENS = 64, 24
TTFT_SLO_X, TPOT_SLO_X = 4.0, 3.0
KV_BYTES_PER_SLOT = 46080  # one token's K and V over 30 layers, 3 KV heads x 64, fp32


def assign(probs: np.ndarray, num_workers: int) -> list[int]:
    """Adapter i -> worker: greedy, most popular first, to the worker with the least popularity so far."""
    load, owner = [0.0] * num_workers, [0] * len(probs)
    for i in np.argsort(-probs, kind="stable"):
        w = min(range(num_workers), key=load.__getitem__)
        owner[i], load[w] = w, load[w] + probs[i]
    return owner


def workloads(names: list[str], owner: list[int], num_requests: int, seed: int) -> list[Workload]:
    """Per worker, its share of one Poisson(1 req/s) stream over Zipf-popular adapters (scaled by time_scale)."""
    rng = np.random.default_rng(seed)
    probs = (1.0 / np.arange(1, len(names) + 1) ** ZIPF_S)
    probs /= probs.sum()
    arrivals = np.cumsum(rng.exponential(1.0, num_requests))
    picks = rng.choice(len(names), size=num_requests, p=probs)
    per_worker: list[list[Request]] = [[] for _ in range(NUM_WORKERS)]
    for i, (t, a) in enumerate(zip(arrivals, picks)):
        per_worker[owner[a]].append(Request(rid=f"r{i}", arrival_s=float(t), session=f"r{i}", turn=0,
                                            adapter=names[a], parent_rid=None, history_tokens=0,
                                            new_tokens=PROMPT_TOKENS, output_tokens=OUTPUT_TOKENS))
    adapters = tuple(AdapterInfo(n, 8) for n in names)
    return [Workload("zipf-experts", seed, {"num_requests": num_requests}, adapters, tuple(reqs))
            for reqs in per_worker]


def replay_arm(arm: str, urls: list[str], parts: list[Workload], scale: float, raw: Path, tag: str) -> list:
    served = [ServedAdapter(a.name) for a in parts[0].adapters]
    results: list[list] = [[] for _ in urls]

    def one(w: int) -> None:
        results[w] = replay(parts[w], [Target(arm, urls[w])], raw, tag, served, time_scale=scale, timeout_s=900,
                            tags={"worker": w, "rate": scale})

    threads = [threading.Thread(target=one, args=(w,)) for w in range(len(urls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for rs in results for r in rs]


def summary(results, ttft_slo: float, tpot_slo: float) -> dict:
    ok = [r for r in results if r.error is None and r.ttft_s is not None]
    if not ok:
        return {"num_ok": 0, "num_failed": len(results)}
    met = {}
    for r in ok:
        met.setdefault(r.adapter, []).append(r.ttft_s <= ttft_slo and (r.tpot_s or 0.0) <= tpot_slo)
    return {"num_ok": len(ok), "num_failed": len(results) - len(ok),
            "ttft_s": [r.ttft_s for r in ok], "tpot_s": [r.tpot_s or 0.0 for r in ok],
            "adapters_met": sum(sum(m) / len(m) > 0.9 for m in met.values()), "adapters_seen": len(met)}


def calibrate(url: str) -> tuple[float, float]:
    """(TTFT, TPOT) of one base request of the benchmark's lengths on an idle worker, median of 3."""
    ttfts, tpots = [], []
    for i in range(3):
        ids = [2000 + (i * 31 + j * 17) % 30000 for j in range(PROMPT_TOKENS)]
        body = {"input_ids": ids, "stream": True,
                "sampling_params": {"max_new_tokens": OUTPUT_TOKENS, "temperature": 0, "ignore_eos": True}}
        start, times = time.perf_counter(), []
        with requests.post(url + "/generate", json=body, stream=True, timeout=600) as res:
            for line in res.iter_lines():
                if line.startswith(b"data:") and line != b"data: [DONE]":
                    times.append(time.perf_counter())
        ttfts.append(times[0] - start)
        tpots.append((times[-1] - times[0]) / max(1, len(times) - 1))
    return statistics.median(ttfts), statistics.median(tpots)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="0.3,0.6,0.9", help="total request rates (req/s) to sweep")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--requests", type=int, default=30, help="requests per replay (both workers together)")
    parser.add_argument("--out", type=Path, default=REPO / "eval/results/remote_lora/remote_serviceable.jsonl")
    args = parser.parse_args()
    from sgl_multilora.embedded_moe import ensure_embedded_moe_model

    model = str(ensure_embedded_moe_model())
    adapter_dir = make_adapters(model, "moe-experts", NUM_ADAPTERS, experts_only=True)
    names = sorted(p.name for p in adapter_dir.iterdir() if (p / "adapter_config.json").exists())[:NUM_ADAPTERS]
    adapter_bytes = max((adapter_dir / n / "adapter_model.safetensors").stat().st_size for n in names)
    adapter_slots = -(-adapter_bytes // KV_BYTES_PER_SLOT)
    server_slots = NUM_WORKERS * (COUPLED_SLOTS - KV_SLOTS) // adapter_slots
    probs = 1.0 / np.arange(1, NUM_ADAPTERS + 1) ** ZIPF_S
    owner = assign(probs / probs.sum(), NUM_WORKERS)
    log_dir = REPO / ".cache" / "remote_lora_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    address = f"ipc://{log_dir}/serviceable.sock"
    load = list(os.getloadavg())
    lora_srv = LoRAServerProcess(adapter_dir, model, address, log_dir / "serviceable_srv.log",
                                 ["--max-slots", str(server_slots)]).start()
    servers: dict[str, list] = {"coupled": [], "disaggregated": []}
    try:
        for w in range(NUM_WORKERS):
            mine = [n for n, o in zip(names, owner) if o == w]
            servers["coupled"].append(launch(model, [
                *cpu_server_args(COUPLED_SLOTS), "--radix-cache-backend", "multilora", "--max-loras-per-batch", "8",
                "--max-lora-rank", "8", "--enable-lora",
                "--lora-paths", *[f"{n}={adapter_dir / n}" for n in mine]], log_path=log_dir / f"coupled{w}.log"))
            servers["disaggregated"].append(launch(model, [
                *cpu_server_args(KV_SLOTS), "--radix-cache-backend", "multilora", "--max-loras-per-batch", "8",
                "--multilora-lora-server", address], log_path=log_dir / f"disagg{w}.log"))
        ttft0, tpot0 = calibrate(servers["coupled"][0].url)
        ttft_slo, tpot_slo = TTFT_SLO_X * ttft0, TPOT_SLO_X * tpot0
        print(f"calibration: TTFT {ttft0:.3f} s, TPOT {tpot0:.3f} s -> SLOs {ttft_slo:.3f} / {tpot_slo:.3f} s")
        raw = log_dir / f"{args.out.stem}_requests.jsonl"  # per request, kept out of eval/results (its size)
        raw.unlink(missing_ok=True)
        runs = []
        for rep in range(args.repeats):
            parts = workloads(names, owner, args.requests, seed=100 + rep)
            for rate in [float(r) for r in args.rates.split(",")]:
                for arm in (["coupled", "disaggregated"] if rep % 2 == 0 else ["disaggregated", "coupled"]):
                    for s in servers[arm]:
                        requests.post(s.url + "/flush_cache", timeout=60)
                    results = replay_arm(arm, [s.url for s in servers[arm]], parts, rate, raw, f"rep{rep}")
                    runs.append({"arm": arm, "repeat": rep, "rate": rate, **summary(results, ttft_slo, tpot_slo)})
                    print(f"rep {rep} rate {rate} {arm}: {runs[-1].get('num_ok')} ok", flush=True)
        setup = {"workers": NUM_WORKERS, "adapters": NUM_ADAPTERS, "zipf_s": ZIPF_S, "coupled_slots": COUPLED_SLOTS,
                 "kv_slots": KV_SLOTS, "adapter_bytes": adapter_bytes, "adapter_slots": adapter_slots,
                 "server_slots": server_slots, "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS,
                 "requests": args.requests, "repeats": args.repeats, "calibration": [ttft0, tpot0],
                 "ttft_slo_s": ttft_slo, "tpot_slo_s": tpot_slo, "owner": owner}
        save(args.out, {**run_record(setup, [], load), "runs": runs}, report)
    finally:
        for handles in servers.values():
            for h in handles:
                h.stop()
        lora_srv.stop()


def report(record: dict) -> str:
    s = record["setup"]
    lines = ["# N workers with one LoRA server against N coupled workers, same memory", "",
             f"{record['date']}, {record['device']['cpu_count']} CPUs, load {record['device']['load_avg_start']}; "
             f"{s['workers']} workers, {s['adapters']} expert adapters of {s['adapter_slots']} token slots each, "
             f"Zipf {s['zipf_s']}; coupled pools {s['coupled_slots']} slots, disaggregated {s['kv_slots']} KV slots "
             f"+ a LoRA server of {s['server_slots']} adapter slots; SLOs P95 TTFT {s['ttft_slo_s']:.2f} s, mean TPOT "
             f"{s['tpot_slo_s']:.3f} s ({TTFT_SLO_X:g}x / {TPOT_SLO_X:g}x the idle base request's); "
             f"{s['repeats']} repeats pooled.", "",
             "| rate (req/s) | arm | P95 TTFT s | mean TPOT s | SLOs met | adapters meeting SLOs in >90% |",
             "|---|---|---|---|---|---|"]
    best = {}
    for rate in sorted({r["rate"] for r in record["runs"]}):
        for arm in ("coupled", "disaggregated"):
            rs = [r for r in record["runs"] if r["rate"] == rate and r["arm"] == arm and r.get("num_ok")]
            ttft = [t for r in rs for t in r["ttft_s"]]
            tpot = [t for r in rs for t in r["tpot_s"]]
            if not ttft:
                continue
            p95, mean_tpot = nearest_rank(ttft, 95), statistics.fmean(tpot)
            ok = p95 <= s["ttft_slo_s"] and mean_tpot <= s["tpot_slo_s"] and not any(r["num_failed"] for r in rs)
            if ok:
                best[arm] = max(best.get(arm, 0.0), rate)
            att = sum(r["adapters_met"] for r in rs) / max(1, sum(r["adapters_seen"] for r in rs))
            lines.append(f"| {rate:g} | {arm} | {p95:.2f} | {mean_tpot:.3f} | {'yes' if ok else 'no'} | {att:.0%} |")
    c, d = best.get("coupled"), best.get("disaggregated")
    ratio = f"{d / c:.2f}x" if c and d else "n/a (an arm meets the SLOs at no swept rate)"
    lines += ["", f"Serviceable rate: coupled {c or 'none'}, disaggregated {d or 'none'} req/s; ratio {ratio}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

"""Live CPU servers, same total memory: adapters and KV in one pool (ours) against SGLang's memory layout (stock).

Arms (both serve the same random PEFT adapters, named and ranked as the workload's, on the embedded model):
- `ours`: `--radix-cache-backend multilora` with `--multilora-memory unified`: a pool of `--pool-tokens` token
  slots shared by adapter weights and KV, evicted and prefetched by `--policy`.
- `ours-mq` (optional): `ours` with the multi-queue scheduler (`--multilora-scheduler multiqueue`, TTFT SLO
  `--slo-s`): the whole stack, adapter-slot squashes included; next to `ours` it shows what the scheduler adds.
- `<arm>-drain` (optional, any arm): that arm with SGLang's LoRA drainer (`--lora-drain-wait-threshold
  --drain-wait-s`), so a baseline can run with and without it in one run: the drainer helps one workload and hurts
  another, and the baseline is reported at its best.
- `stock`: SGLang's own prefix cache and SGLang's memory split: slot buffers for `--max-loras-per-batch` adapters
  of `--max-lora-rank` over the adapters' target modules are taken off the same budget, and the KV pool gets the
  rest (`--max-total-tokens` = pool tokens - buffer bytes / slot bytes). On the CPU path SGLang's LoRA layers do not
  run, so the stock arm computes with our CPU LoRA layers from the host copies: its adapter swaps into slot buffers
  cost nothing here (in SGLang they are host-to-device copies), which favours the stock arm.
- `ours-mq[-cap<N>]-hold<X>[-strict|-backfill]` (optional, before `-drain`): the multi-queue arm with
  `--multilora-memory-hold-share X` (0: never hold), `-backfill` with `--multilora-hold-backfill` too (`-strict`:
  without, the default), to weigh the memory hold and its backfill against the defaults in one run.
- `<arm>-nomove` (optional, ours and ours-mq, before `-drain`): that arm with `--multilora-disable-kv-moves`: runs for
  an adapter's matrices are freed by eviction only, never by moving KV, to weigh the moves in one run.
- `<arm>-host<GB>` (optional, ours and ours-mq, before `-drain`): that arm with a host tier of GB for the KV its
  pool evicts (`--multilora-host-kv-gb`). More memory than the other arms are given on the device: the report names
  it, and a fair stock counterpart is SGLang's HiCache with the same host memory (which does not start on CPU).
- `ours-mq...-overdue<S>` (optional, before `-drain`): the multi-queue arm with `--multilora-overdue-s S` (requests
  waiting S seconds go first, oldest first), to weigh that bound on the tail in one run.
- `ours-mq...-protect` (optional, before `-drain`): the multi-queue arm with `--multilora-protect-queued-kv` (the
  plan's budget leaves out the histories waiting requests would reuse).
- `ours-mq...-room<X>` (optional, before `-drain`): the multi-queue arm with `--multilora-room-squash-share X`
  (running decodes retracted for a request that has waited X of the SLO for KV room).
- `<arm>-cap<N>` (optional, any arm, before `-drain`): that arm with `--max-loras-per-batch N` instead of the common
  cap. SGLang's cap is what its slot buffers are sized by, so a stock arm's KV pool shrinks or grows with it; our
  pool holds adapters in KV memory and the LoRA compute reads them in place, so a larger cap costs our arms nothing.
  Each side is then compared at its own best setting: the headline takes, at each rate, the stock arm with the lower
  median mean TTFT, whatever its cap or drainer.
Both servers start once and stay up (idle ones sleep); every repeat replays the workload at every rate on each arm,
arms alternating in order, each replay on a flushed cache. A repeat of one arm at one rate gives mean / P50 / P99
TTFT; the report gives the median and spread (min, max) over repeats and the per-repeat ratios ours / stock, and
mean and P99 over every repeat's requests together (`--pooled-only` prints those from a committed request log): a
repeat's own P99 is one of its slowest few requests.

Next to the record and its report (`--out`, `.md`), the per-request log (`_requests.jsonl`) and the TTFT
distribution per rate and arm, every repeat pooled (`.png`; `--plot-only` redraws it from a committed request log).

Usage: .venv/bin/python -m eval.bench.unified_memory [--workload chatbot] [--time-scales 1,2] [--repeats 3]
           [--out eval/results/unified_memory/unified_memory.jsonl] [--plot-only] [--pooled-only]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import statistics
import time
from pathlib import Path

import requests
from tqdm import tqdm

from eval.bench.results import nearest_rank, save
from eval.live.driver import ServedAdapter, Target, replay
from eval.workloads import create_workload
from sgl_multilora.server import cpu_server_args, launch

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "unified_memory_adapters"
# SmolLM2-135M, fp32: per layer and rank, A and B elements of each projection (in + out)
ELEMS_PER_RANK = {"q_proj": 576 + 576, "k_proj": 576 + 192, "v_proj": 576 + 192, "o_proj": 576 + 576,
                  "gate_proj": 576 + 1536, "up_proj": 576 + 1536, "down_proj": 1536 + 576}
NUM_LAYERS, SLOT_BYTES = 30, 46080  # a slot: one token's K and V over 30 layers, 3 KV heads x 64, fp32


def make_adapters(model_path: str, workload, out_dir: Path) -> Path:
    """Random PEFT adapters (seeded per name) with the workload's names, ranks and target modules; reused when
    present."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    todo = [a for a in workload.adapters if not (out_dir / a.name / "adapter_model.safetensors").exists()]
    if not todo:
        return out_dir
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    for i, a in enumerate(tqdm(todo, desc="random adapters")):
        torch.manual_seed(1000 + i)
        config = LoraConfig(r=a.rank, lora_alpha=2 * a.rank, init_lora_weights=False, task_type="CAUSAL_LM",
                            target_modules=list(a.target_modules))
        model = get_peft_model(base, config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(0.5)
        model.save_pretrained(str(out_dir / a.name))
        base = model.unload()
    return out_dir


def stock_buffer_tokens(workload, max_loras_per_batch: int, max_rank: int) -> int:
    """Token slots SGLang's LoRA slot buffers take: max_loras_per_batch adapters of max_rank over the union of
    the workload's target modules, fp32, every layer."""
    modules = sorted({m for a in workload.adapters for m in a.target_modules})
    per_adapter = NUM_LAYERS * max_rank * sum(ELEMS_PER_RANK[m] for m in modules) * 4
    return -(-max_loras_per_batch * per_adapter // SLOT_BYTES)


ARM_BASES = ("stock", "ours", "ours-mq")


def split_hold(name: str) -> tuple[str, float | None]:
    """`<...>-hold<X>[-strict|-backfill][-drain]` -> (the name without `-hold<X>[-strict|-backfill]`, X), else
    (name, None); `-nomove` and `-host<GB>` are dropped first. Raises ValueError for a share that is not a number
    >= 0, or a mode without `-hold<X>`."""
    name = _without_options(name)
    head, sep, tail = name.partition("-hold")
    if not sep:
        if hold_mode(name):
            raise ValueError(f"unknown arm {name!r}: -strict and -backfill follow -hold<X>")
        return name, None
    share, _, rest = tail.partition("-")
    try:
        value = float(share)
    except ValueError:
        value = -1.0
    mode, _, drain = rest.partition("-") if rest != "drain" else ("", "", "drain")
    if value < 0 or mode not in HOLD_MODES or drain not in ("", "drain"):
        raise ValueError(f"unknown arm {name!r}: -hold<X> takes a memory-hold share X >= 0 (0: never hold), "
                         "then -strict (the hold admits nothing else) or -backfill, and -drain, each optional")
    return head + ("-drain" if drain else ""), value


HOLD_MODES = ("", "strict", "backfill")
"""`-hold<X>-strict`: the arm's memory hold admits nothing else (the default since backfill went off by default;
the name kept for the records that ran it with the backfill on by default); `-backfill`:
`--multilora-hold-backfill`."""


def hold_mode(name: str) -> str:
    """"strict", "backfill" or "" (the server's default) for an arm name (`parse_arm` checks the name)."""
    for mode in HOLD_MODES[1:]:
        if f"-{mode}" in name:
            return mode
    return ""


def no_kv_moves(name: str) -> bool:
    """Whether the arm runs with `--multilora-disable-kv-moves` (`-nomove` in its name)."""
    return "-nomove" in name


def protects_queued_kv(name: str) -> bool:
    """Whether the arm runs with `--multilora-protect-queued-kv` (`-protect` in its name)."""
    return "-protect" in name


def _positive_option(pattern: re.Pattern, name: str, usage: str) -> float | None:
    """The number after an option of the arm name (`pattern`'s group), else None. Raises ValueError naming `usage`
    for a value that is not a number > 0."""
    match = pattern.search(name)
    if match is None:
        return None
    value = float(match.group(1)) if _NUMBER.fullmatch(match.group(1)) else 0.0
    if value <= 0:
        raise ValueError(f"unknown arm {name!r}: {usage}")
    return value


def host_gb(name: str) -> float | None:
    """The arm's host tier in GB (`-host<GB>` in its name), else None. Raises ValueError for a size that is not a
    number > 0."""
    return _positive_option(_HOST, name, "-host<GB> takes a host tier size GB > 0")


def overdue_s(name: str) -> float | None:
    """The arm's `--multilora-overdue-s` (`-overdue<S>` in its name), else None. Raises ValueError for a value that
    is not a number > 0."""
    return _positive_option(_OVERDUE, name, "-overdue<S> takes a wait S > 0 in seconds")


def room_share(name: str) -> float | None:
    """The arm's `--multilora-room-squash-share` (`-room<X>` in its name), else None. Raises ValueError for a value
    that is not a number > 0."""
    return _positive_option(_ROOM, name, "-room<X> takes a share X > 0 of the TTFT SLO")


_HOST = re.compile(r"-host([^-]*)")
_OVERDUE = re.compile(r"-overdue([^-]*)")
_ROOM = re.compile(r"-room([^-]*)")
_NUMBER = re.compile(r"[0-9]+(\.[0-9]*)?")


def _without_options(name: str) -> str:
    """The arm name without its `-nomove`, `-protect`, `-host<GB>`, `-overdue<S>` and `-room<X>` parts (the rest of
    the grammar is positional)."""
    name = _HOST.sub("", name.replace("-nomove", "", 1).replace("-protect", "", 1), count=1)
    return _ROOM.sub("", _OVERDUE.sub("", name, count=1), count=1)


def parse_arm(name: str) -> tuple[str, int | None, bool]:
    """`<base>[-cap<N>][-hold<X>[-strict|-backfill]][-nomove][-protect][-host<GB>][-overdue<S>][-room<X>][-drain]`
    -> (base, cap or None for the common one, drainer on); `-hold<X>` (`split_hold`), `-protect`
    (`protects_queued_kv`), `-overdue<S>` (`overdue_s`) and `-room<X>` (`room_share`) only on `ours-mq`, `-nomove`
    (`no_kv_moves`) and `-host<GB>` (`host_gb`) not on `stock`. Raises ValueError for any other name."""
    ours_only = "-nomove" if no_kv_moves(name) else "-host<GB>" if host_gb(name) is not None else None
    mq_only = ("-overdue<S>" if overdue_s(name) is not None else "-room<X>" if room_share(name) is not None
               else "-protect" if protects_queued_kv(name) else None)
    bare, hold = split_hold(name)
    rest, drain = (bare[:-len("-drain")], True) if bare.endswith("-drain") else (bare, False)
    base, _, cap = rest.partition("-cap")
    if base not in ARM_BASES or (cap and not (cap.isdigit() and int(cap) >= 1)) or rest.endswith("-cap") or (
            hold is not None and base != "ours-mq"):
        raise ValueError(f"unknown arm {name!r}: expected <base>[-cap<N>][-hold<X>[-<mode>]][-nomove][-host<GB>]"
                         f"[-drain], base one of {', '.join(ARM_BASES)}, -hold<X> only on ours-mq")
    if ours_only and base == "stock":
        raise ValueError(f"unknown arm {name!r}: {ours_only} is an option of our arms, not of stock SGLang")
    if mq_only and base != "ours-mq":
        raise ValueError(f"unknown arm {name!r}: {mq_only} is an option of the multi-queue scheduler (ours-mq)")
    return base, int(cap) if cap else None, drain


def arm_spec(name: str, args: argparse.Namespace, workload, max_rank: int) -> tuple[int, list[str]]:
    """An arm's token slots (`--max-total-tokens`) and its own flags. Stock arms give their slot buffers' share of
    `--pool-tokens` up, at their own cap; ours keep every slot. Raises ValueError for an unknown name or a cap whose
    buffers leave a stock arm no KV."""
    base, cap, drain = parse_arm(name)
    cap = args.max_loras_per_batch if cap is None else cap
    extra = ["--max-loras-per-batch", str(cap)]
    tokens = args.pool_tokens
    if base == "stock":
        tokens -= stock_buffer_tokens(workload, cap, max_rank)
        if tokens <= 0:
            raise ValueError(f"{name}: SGLang's slot buffers for {cap} adapters of rank {max_rank} take "
                             f"{args.pool_tokens - tokens} token slots, more than --pool-tokens {args.pool_tokens}")
    else:
        extra += ["--radix-cache-backend", "multilora", "--multilora-eviction-policy", args.policy]
    if base == "ours-mq":
        extra += ["--multilora-scheduler", "multiqueue", "--multilora-ttft-slo-s", f"{args.slo_s:g}"]
        hold = split_hold(name)[1]
        if hold is not None:
            extra += ["--multilora-memory-hold-share", f"{hold:g}"]
        if hold_mode(name) == "backfill":
            extra += ["--multilora-hold-backfill"]
        if overdue_s(name) is not None:
            extra += ["--multilora-overdue-s", f"{overdue_s(name):g}"]
        if room_share(name) is not None:
            extra += ["--multilora-room-squash-share", f"{room_share(name):g}"]
        if protects_queued_kv(name):
            extra += ["--multilora-protect-queued-kv"]
    if no_kv_moves(name):
        extra += ["--multilora-disable-kv-moves"]
    if host_gb(name) is not None:
        extra += ["--multilora-host-kv-gb", f"{host_gb(name):g}"]
    if drain:
        extra += ["--lora-drain-wait-threshold", f"{args.drain_wait_s:g}"]
    return tokens, extra


def flush(url: str) -> None:
    requests.post(url + "/flush_cache", timeout=60)


def summarize(results) -> dict:
    ok = [r for r in results if r.error is None and r.ttft_s is not None]
    ttft = sorted(r.ttft_s for r in ok)
    if not ttft:
        return {"num_ok": 0, "num_failed": len(results)}

    def pct(p):
        return nearest_rank(ttft, p)

    return {"num_ok": len(ok), "num_failed": len(results) - len(ok), "mean_ttft_s": statistics.fmean(ttft),
            "p50_ttft_s": pct(50), "p99_ttft_s": pct(99),
            "mean_e2e_s": statistics.fmean(r.e2e_s for r in ok),
            "cached_token_share": sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok))}


def workload_from_args(args: argparse.Namespace) -> tuple[str, object, tuple[int, ...], dict]:
    """The embedded model's path and the workload that --workload, --num-adapters, --ranks, --param and --seed
    name, with its ranks and parameters."""
    from sgl_multilora.embedded import ensure_embedded_model

    model = str(ensure_embedded_model())
    ranks = tuple(int(r) for r in args.ranks.split(","))
    params = {"num_adapters": args.num_adapters, "ranks": ranks}
    for item in args.param:
        key, value = item.split("=", 1)
        params[key] = json.loads(value)
    return model, create_workload(args.workload, seed=args.seed, **params), ranks, params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="chatbot", choices=["chatbot", "translation"])
    parser.add_argument("--num-adapters", type=int, default=24)
    parser.add_argument("--ranks", default="16,32,64")
    parser.add_argument("--pool-tokens", type=int, default=10000, help="token slots every arm gets in all")
    parser.add_argument("--max-loras-per-batch", type=int, default=4)
    parser.add_argument("--policy", default="elora")
    parser.add_argument("--time-scales", default="1,2", help="arrival compression factors (the rates)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--param", action="append", default=[], help="workload parameter NAME=VALUE")
    parser.add_argument("--server-args", default="",
                        help="more SGLang flags for every arm alike (e.g. '--lora-drain-wait-threshold 2')")
    parser.add_argument("--arms", default="ours,stock",
                        help="which arms to run (comma-separated): ours, ours-mq, stock, and any of them with "
                        "-drain appended")
    parser.add_argument("--drain-wait-s", type=float, default=2.0,
                        help="the -drain arms' --lora-drain-wait-threshold (seconds)")
    parser.add_argument("--slo-s", type=float, default=2.0, help="the ours-mq arm's --multilora-ttft-slo-s")
    parser.add_argument("--out", type=Path, default=REPO / "eval/results/unified_memory/unified_memory.jsonl")
    parser.add_argument("--plot-only", action="store_true",
                        help="only redraw the TTFT plot (.png next to --out) from its request log")
    parser.add_argument("--pooled-only", action="store_true",
                        help="only print every arm's mean and P99 TTFT over all repeats together, from the request "
                        "log next to --out")
    args = parser.parse_args()
    if args.pooled_only:
        print("\n".join(pooled_lines(request_ttfts(args.out.with_name(args.out.stem + "_requests.jsonl")))))
        return
    if args.plot_only:
        print(plot_ttft(args.out.with_name(args.out.stem + "_requests.jsonl"), args.out.with_suffix(".png")))
        return

    model, workload, ranks, params = workload_from_args(args)
    adapters_dir = make_adapters(model, workload, CACHE / f"{args.workload}-{args.num_adapters}-{args.ranks}")
    max_rank = max(ranks)
    buffer_tokens = stock_buffer_tokens(workload, args.max_loras_per_batch, max_rank)
    common = ["--multilora-adapter-dir", str(adapters_dir), "--max-lora-rank", str(max_rank),
              *shlex.split(args.server_args)]
    arms = {}
    for name in args.arms.split(","):
        try:
            arms[name] = arm_spec(name, args, workload, max_rank)
        except ValueError as exc:
            parser.error(str(exc))
    arms = {name: (tokens, [*common, *extra]) for name, (tokens, extra) in arms.items()}
    log_dir = REPO / ".cache" / "bench_logs"  # a log per output file and arm: a later run keeps this run's logs
    log_dir.mkdir(parents=True, exist_ok=True)
    servers = {}
    try:
        for name, (tokens, extra) in arms.items():
            servers[name] = launch(model, [*cpu_server_args(max_total_tokens=tokens), *extra],
                                   log_path=log_dir / f"{args.out.stem}_{name}.log")
        served = [ServedAdapter(a.name) for a in workload.adapters]
        scales = [float(s) for s in args.time_scales.split(",")]
        setup = {"workload": args.workload, "params": {k: list(v) if isinstance(v, tuple) else v
                                                       for k, v in params.items()},
                 "num_requests": len(workload.requests), "pool_tokens": args.pool_tokens,
                 "stock_kv_tokens": args.pool_tokens - buffer_tokens, "stock_buffer_tokens": buffer_tokens,
                 "max_loras_per_batch": args.max_loras_per_batch, "max_lora_rank": max_rank,
                 "policy": args.policy, "server_args": args.server_args, "time_scales": scales,
                 "arms": {name: extra[len(common):] for name, (_, extra) in arms.items()},
                 "arm_tokens": {name: tokens for name, (tokens, _) in arms.items()}, "slo_s": args.slo_s,
                 "repeats": args.repeats, "seed": args.seed,
                 "adapter_bytes_total": sum(NUM_LAYERS * a.rank * sum(ELEMS_PER_RANK[m] for m in a.target_modules)
                                            * 4 for a in workload.adapters)}
        device = {"processor": platform.processor(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
                  "load_avg_start": list(os.getloadavg())}
        runs = []
        raw = args.out.with_name(args.out.stem + "_requests.jsonl")
        raw.unlink(missing_ok=True)
        order = list(arms)
        with tqdm(total=args.repeats * len(scales) * len(order), desc="replays") as bar:
            for rep in range(args.repeats):
                for scale in scales:
                    for name in (order if rep % 2 == 0 else order[::-1]):
                        flush(servers[name].url)
                        time.sleep(1.0)
                        results = replay(workload, [Target(name, servers[name].url)], raw, f"rep{rep}", served,
                                         time_scale=scale, timeout_s=900)
                        pool = None
                        if name.startswith("ours"):
                            mem = requests.get(servers[name].url + "/multilora/stats", timeout=60).json()["memory"]
                            unified = mem[0].get("unified_pool", {})
                            pool = {**unified.get("swapper", {}),
                                    **{k: unified.get(k) for k in ("skipped_admissions", "starvation_holds",
                                                                   "budget_stops", "lora_batch_skips")}}
                            host = unified.get("host_tier") or {}
                            pool.update({f"host_{k}": host[k] for k in ("load_backs", "declined_load_backs")
                                         if k in host})
                            if mem[0].get("scheduler"):
                                pool["scheduler_counts"] = mem[0]["scheduler"]["counts"]
                        runs.append({"arm": name, "repeat": rep, "time_scale": scale,
                                     "rate_req_s": workload.offered_rate * scale, **summarize(results),
                                     "swapper": pool})
                        bar.update(1)
        device["load_avg_end"] = list(os.getloadavg())
        record = {"setup": setup, "device": device, "date": datetime.datetime.now(datetime.UTC).isoformat(),
                  "runs": runs, "plot": plot_ttft(raw, args.out.with_suffix(".png")).name,
                  "pooled": pooled_lines(request_ttfts(raw))}
        save(args.out, record, report)
    finally:
        for handle in servers.values():
            handle.stop()


COLORS = {"stock": "tab:gray", "ours": "tab:blue", "ours-mq": "tab:green"}


CAP_STYLES = ("-", ":", "-.", (0, (5, 1, 1, 1, 1, 1)))
"""Line style of an arm in the plot by its (cap, hold share)'s place among its base's (the common cap first); the
drainer draws the line thinner, with circles."""


def ordered_arms(names) -> list[str]:
    """The arms among `names` in report order: stock, ours, ours-mq, each at the common cap first, then by cap, the
    drainer after each."""
    def key(name):
        base, cap, drain = parse_arm(name)
        hold = split_hold(name)[1]
        return (ARM_BASES.index(base), cap or 0, hold is not None, hold or 0.0, hold_mode(name), no_kv_moves(name),
                host_gb(name) or 0.0, overdue_s(name) or 0.0, room_share(name) or 0.0, protects_queued_kv(name),
                drain)

    return sorted(names, key=key)


def plot_ttft(raw: Path, png: Path) -> Path:
    """The TTFT distribution (CDF, log time axis) of every request in the request log `raw`, one panel per rate,
    one line per arm, all repeats pooled; saved as `png`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ttfts = request_ttfts(raw)
    fig, axes = plt.subplots(1, len(ttfts), figsize=(max(7.0, 5.5 * len(ttfts)), 4), squeeze=False, sharey=True)
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    def setting(arm: str) -> tuple:  # an arm's line style follows its cap (0: the common one) and memory hold
        return parse_arm(arm)[1] or 0, split_hold(arm)[1], hold_mode(arm), no_kv_moves(arm), host_gb(arm)

    caps: dict[str, list] = {}  # base -> its arms' settings in order
    for arm in ordered_arms({a for by_arm in ttfts.values() for a in by_arm}):
        if setting(arm) not in caps.setdefault(parse_arm(arm)[0], []):
            caps[parse_arm(arm)[0]].append(setting(arm))
    for ax, rate in zip(axes[0], sorted(ttfts)):
        for arm in ordered_arms(ttfts[rate]):
            xs = sorted(ttfts[rate][arm])
            base, _, drain = parse_arm(arm)
            style = CAP_STYLES[caps[base].index(setting(arm)) % len(CAP_STYLES)]
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", color=COLORS[base],
                    linestyle=style, linewidth=1.0 if drain else 1.6, marker="o" if drain else None,
                    markevery=max(1, len(xs) // 8), markersize=3,
                    label=f"{arm} (n={len(xs)}, P99 {nearest_rank(xs, 99):.1f} s)")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("TTFT (s)")
        ax.set_title(f"{rate:.2f} req/s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    axes[0][0].set_ylabel("share of requests")
    fig.suptitle("TTFT, same memory: unified pool (ours), with the multi-queue scheduler (ours-mq),\n"
                 "SGLang's memory layout (stock)", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def request_ttfts(raw: Path) -> dict[float, dict[str, list[float]]]:
    """TTFTs of the request log's served requests by rate (req/s, rounded to 0.01) and arm, every repeat together."""
    ttfts: dict[float, dict[str, list[float]]] = {}
    for line in raw.read_text().splitlines():
        r = json.loads(line)
        if r.get("error") is None and r.get("ttft_s") is not None:
            rate = round(r["extra"]["request_rate"], 2)
            ttfts.setdefault(rate, {}).setdefault(r["arm"], []).append(r["ttft_s"])
    return ttfts


def best_stock_pooled(by_arm: dict[str, list[float]]) -> str | None:
    """The stock arm (any cap or drainer) with the lower mean over every repeat's requests, None when there is none."""
    stock = [a for a in by_arm if a.startswith("stock")]
    return min(stock, key=lambda a: statistics.fmean(by_arm[a])) if stock else None


def pooled_lines(ttfts: dict[float, dict[str, list[float]]]) -> list[str]:
    """Per rate, every arm's mean and P99 TTFT over every repeat's requests together, and each of ours against the
    stock arm with the lower pooled mean. A run's P99 is one of its slowest few requests and moves with them from
    repeat to repeat; pooled over repeats it rests on several (nearest rank of n times the repeats)."""
    lines = []
    for rate in sorted(ttfts):
        by_arm = ttfts[rate]
        best = best_stock_pooled(by_arm)
        parts = []
        for arm in ordered_arms(by_arm):
            v = by_arm[arm]
            text = f"{arm} {statistics.fmean(v):.2f} / {nearest_rank(v, 99):.2f} s (n {len(v)})"
            if best and not arm.startswith("stock"):
                b = by_arm[best]
                text += (f", {statistics.fmean(v) / statistics.fmean(b):.2f}x / "
                         f"{nearest_rank(v, 99) / nearest_rank(b, 99):.2f}x {best}'s")
            parts.append(text)
        lines.append(f"- {rate:.2f} req/s, mean / P99 TTFT: " + "; ".join(parts))
    return lines


def report(record: dict) -> str:
    s, runs = record["setup"], record["runs"]
    lines = [f"# Unified pool vs SGLang's memory layout, live CPU server ({record['date'][:10]})", "",
             f"Workload `{s['workload']}` {s['params']}, {s['num_requests']} requests; every arm {s['pool_tokens']} "
             f"token slots in all (stock: {s['stock_buffer_tokens']} to LoRA slot buffers of "
             f"{s['max_loras_per_batch']} x rank {s['max_lora_rank']}, {s['stock_kv_tokens']} to KV); adapters "
             f"{s['adapter_bytes_total'] / 2**20:.0f} MiB = {s['adapter_bytes_total'] / 46080:.0f} slots; policy "
             f"{s['policy']}; {'every arm ' + repr(s['server_args']) + '; ' if s.get('server_args') else ''}"
             f"{'arms ' + repr(s['arms']) + '; ' if s.get('arms') else ''}"
             f"{s['repeats']} repeats, arms alternating. Machine: {record['device']}.", "",
             *([f"KV token slots per arm (`--max-total-tokens`): "
                + ", ".join(f"{a} {t}" for a, t in s["arm_tokens"].items()) + ".", ""] if s.get("arm_tokens") else []),
             "| rate (req/s) | arm | mean TTFT s (min-max) | P50 TTFT s | P99 TTFT s (min-max) | cached share | "
             "failed |", "|---|---|---|---|---|---|---|"]
    arms = ordered_arms({r["arm"] for r in runs})
    baselines = [a for a in arms if a.startswith("stock")]
    hosts = {a: host_gb(a) for a in arms if host_gb(a) is not None}
    if hosts:
        lines[-2:-2] = ["Host memory beyond the pool: " + ", ".join(f"{a} {gb:g} GB" for a, gb in hosts.items())
                        + " for the KV its pool evicts; every other arm none (SGLang's HiCache, stock's way to "
                        "use host memory, does not start on the CPU path), so those arms have more memory.", ""]
    for scale in s["time_scales"]:
        for arm in arms:
            rs = [r for r in runs if r["arm"] == arm and r["time_scale"] == scale and r.get("num_ok")]
            if not rs:
                continue

            def med(key):
                return statistics.median(r[key] for r in rs)

            lines.append(
                f"| {rs[0]['rate_req_s']:.2f} | {arm} | {med('mean_ttft_s'):.2f} "
                f"({min(r['mean_ttft_s'] for r in rs):.2f}-{max(r['mean_ttft_s'] for r in rs):.2f}) | "
                f"{med('p50_ttft_s'):.2f} | {med('p99_ttft_s'):.2f} ({min(r['p99_ttft_s'] for r in rs):.2f}-"
                f"{max(r['p99_ttft_s'] for r in rs):.2f}) | {med('cached_token_share'):.2f} | "
                f"{sum(r['num_failed'] for r in rs)} |")
    for ours, stock in [(a, b) for b in baselines for a in arms if a not in baselines]:
        lines += ["", f"Ratios {ours} / {stock} per repeat (median, min-max):", ""]
        for scale in s["time_scales"]:
            mean_r, p99_r = repeat_ratios(record, ours, stock, scale)
            if mean_r:
                lines.append(f"- time scale {scale:g}: mean TTFT {statistics.median(mean_r):.2f} "
                             f"({min(mean_r):.2f}-{max(mean_r):.2f}), P99 TTFT {statistics.median(p99_r):.2f} "
                             f"({min(p99_r):.2f}-{max(p99_r):.2f})")
    lines += headline_lines(record, arms, baselines)
    for ours in [a for a in arms if a not in baselines]:
        last = [r["swapper"] for r in runs if r["arm"] == ours and r.get("swapper")]
        if last and "lora_batch_skips" in last[-1]:
            keys = ("adapter_loads", "adapter_evictions", "prefetches", "refused_loads", "unreachable_runs",
                    "kv_compactions", "kv_moved_slots", "kv_evicted_slots", "kv_evicted_slots_by_age",
                    "host_load_backs", "host_declined_load_backs", "skipped_admissions", "starvation_holds",
                    "budget_stops", "lora_batch_skips", "scheduler_counts")
            lines += ["", f"{ours}'s pool and admission counters over the whole run: "
                      + ", ".join(f"{k} {last[-1][k]}" for k in keys if last[-1].get(k) is not None) + "."]
    if record.get("pooled"):
        lines += ["", "Every repeat's requests pooled (the P99 of each run alone is one of its slowest few requests):",
                  "", *record["pooled"]]
    if record.get("plot"):
        lines += ["", f"TTFT distribution per rate, every repeat pooled: `{record['plot']}`."]
    return "\n".join(lines) + "\n"


def repeat_ratios(record: dict, ours: str, stock: str, scale: float) -> tuple[list[float], list[float]]:
    """Per repeat at time scale `scale` where both arms served requests: ours / stock mean TTFT, and P99 TTFT."""
    def run(arm, rep):
        return next((r for r in record["runs"] if r["arm"] == arm and r["repeat"] == rep and r["time_scale"] == scale
                     and r.get("num_ok")), None)

    pairs = [(o, k) for o, k in ((run(ours, rep), run(stock, rep)) for rep in range(record["setup"]["repeats"]))
             if o and k]
    return ([o["mean_ttft_s"] / k["mean_ttft_s"] for o, k in pairs],
            [o["p99_ttft_s"] / k["p99_ttft_s"] for o, k in pairs])


def headline_lines(record: dict, arms: list[str], baselines: list[str]) -> list[str]:
    """Each of our arms against the better stock arm at each rate: the stock arm (any cap, with or without the
    drainer) with the lower median mean TTFT over repeats; the ratios are the medians of the per-repeat ratios to
    it, with their spread."""
    s, runs = record["setup"], record["runs"]
    if not baselines:
        return []
    lines = ["", "Against the better stock arm at each rate (the one with the lower median mean TTFT; ELORA's goal: "
             "mean at most 0.5x, P99 at most 0.25x):", ""]
    for scale in s["time_scales"]:
        def ok(arm):
            return [r for r in runs if r["arm"] == arm and r["time_scale"] == scale and r.get("num_ok")]

        scored = [(statistics.median(r["mean_ttft_s"] for r in ok(b)), b) for b in baselines if ok(b)]
        if not scored:
            continue
        best = min(scored)[1]
        rate = ok(best)[0]["rate_req_s"]
        for ours in [a for a in arms if a not in baselines]:
            mean_r, p99_r = repeat_ratios(record, ours, best, scale)
            if mean_r:
                lines.append(f"- {rate:.2f} req/s, {ours} / {best}: mean TTFT {statistics.median(mean_r):.2f}x "
                             f"({min(mean_r):.2f}-{max(mean_r):.2f}), P99 TTFT {statistics.median(p99_r):.2f}x "
                             f"({min(p99_r):.2f}-{max(p99_r):.2f}), {len(mean_r)} repeats")
    return lines


if __name__ == "__main__":
    main()

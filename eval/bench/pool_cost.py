"""Per-step cost of the core memory system (tree + unified pool + swapper + policy) against SGLang's `RadixCache`
with its own KV allocator, on the same request stream, in one process on the CPU.
Not here: the objects measured (sgl_multilora/pool.py, swapper.py, tree.py) or whole-server latency (eval/live/).

Stream: `--conversations` multi-turn conversations, each on one of `--adapters` LoRA adapters (Zipf popularity);
a turn's prompt is its conversation's history plus new tokens, its output is appended for the next turn, and a
conversation starts over after `--max-turns`. One step serves one request as a scheduler does:
- stock: `match_prefix` (extra_key = the adapter's id), `inc_lock_ref`, the prefix's indices
  (`path_device_indices`), `evict` when the allocator is short, `alloc`, `insert`, free the duplicates,
  `dec_lock_ref`. SGLang keeps adapters in a separate pool, so nothing adapter-related is timed there.
- ours:<policy>: `UsageStats` updates, `Swapper.tick` (idle prefetch every 0.1 s of the stream's clock), an
  on-demand `Swapper.load` when the adapter is absent (the copy finishes at once), `match`, `lock`, `make_room`
  when the pool is short (scores and evicts KV leaves and adapters), `alloc`, `insert`, move / free, `unlock`.
  The pool tracks slot ids and is shared with the adapters (Llama-3-8B q/k/v/o, ranks 8-64, 128 KiB slots).
  `make_room` frees 1% of the pool beyond the request (the swapper's headroom), so a scoring pass serves many
  steps; `ours:lru:headroom=0` evicts only the shortfall, on every step once the pool is full, as stock does:
  the like-for-like cost of the data structures. `ours:<policy>:waiting=N` keeps the last N requests of the
  stream queued (each step admits the oldest, so it serves the same stream N steps later) and gives the swapper
  what a server's queue gives it: their adapters and the KV their prefixes match are evicted last, the prefixes
  matched at the first eviction of a step (`LoraRadixTree.prefix_nodes`); the timed step includes that work.
Both start empty and run the stream until the pool is full (eviction has begun) and then `--warmup` steps more, to
a steady state (with the default 900k slots, about 10k tree nodes and 100 adapters); then `--steps` steps are
timed one by one (perf_counter, the garbage collector on, as in a server). Arms rotate within each repeat; the
report gives, per pool size, each arm's median (min-max) over repeats and the per-repeat ratios to stock.

Usage: .venv/bin/python -m eval.bench.pool_cost [--pool-slots 100000,300000,900000] [--steps 4000] [--repeats 3]
           [--out eval/results/pool_cost/pool_cost.jsonl]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import random
import statistics
import time
from array import array
from collections import deque
from collections.abc import Iterator
from pathlib import Path

DEFAULT_ARMS = "stock,ours:elora,ours:lru,ours:lru:headroom=0"
KV_BYTES_PER_TOKEN = 131072  # Llama-3-8B bf16: 2 x 32 layers x 8 heads x 128 x 2 B
BYTES_PER_RANK = 26624 * 32 * 2  # q/k/v/o LoRA A and B rows per rank, 32 layers, bf16 (seed-elora.md A2)


def stream(args) -> Iterator[tuple[int, list[int], list[int]]]:
    """(adapter index, prompt, prompt + output) per step, without end; the same for every arm."""
    rng = random.Random(args.seed)
    weights = [1.0 / (i + 1) ** args.zipf for i in range(args.adapters)]
    conv_adapter = rng.choices(range(args.adapters), weights, k=args.conversations)
    history: list[list[int]] = [[] for _ in range(args.conversations)]
    turns = [0] * args.conversations
    system = [rng.randrange(1000, 50000) for _ in range(32)]
    while True:
        c = rng.randrange(args.conversations)
        if turns[c] == args.max_turns:
            history[c], turns[c] = [], 0
        prompt = (history[c] or system) + [rng.randrange(1000, 50000) for _ in range(rng.randint(16, 48))]
        full = prompt + [rng.randrange(1000, 50000) for _ in range(rng.randint(8, 32))]
        history[c], turns[c] = full, turns[c] + 1
        yield conv_adapter[c], prompt, full



def radix_cache_nodes(cache) -> int:
    """Nodes of SGLang's `RadixCache` below its root."""
    count, stack = -1, [cache.root_node]
    while stack:
        node = stack.pop()
        count += 1
        stack.extend(node.children.values())
    return count

class Stock:
    def __init__(self, args) -> None:
        import torch
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_prefix_cache import (
            EvictParams,
            InsertParams,
            MatchPrefixParams,
        )
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

        self.torch, self.key, self.params = torch, RadixKey, (EvictParams, InsertParams, MatchPrefixParams)
        self.alloc = TokenToKVPoolAllocator(args.pool_slots, torch.int64, "cpu", None, need_sort=False)
        self.cache = RadixCache.create_simulated(mock_allocator=self.alloc)
        self.lora_ids = [f"{i:032x}" for i in range(args.adapters)]
        self.num_evict_calls = 0

    def step(self, adapter: int, prompt: list[int], full: list[int]) -> None:
        cache, alloc, extra, key = self.cache, self.alloc, self.lora_ids[adapter], self.key
        EvictParams, InsertParams, MatchPrefixParams = self.params
        m = cache.match_prefix(MatchPrefixParams(key=key(array("q", prompt), extra_key=extra)))
        node = m.last_device_node
        cache.inc_lock_ref(node)
        prefix = cache.path_device_indices(node)
        need = len(full) - m.device_prefix_len
        if alloc.available_size() < need:
            cache.evict(EvictParams(num_tokens=need - alloc.available_size()))
            self.num_evict_calls += 1
        new = alloc.alloc(need)
        value = self.torch.cat((prefix, new))
        res = cache.insert(InsertParams(key=key(array("q", full), extra_key=extra), value=value))
        if res.prefix_len > m.device_prefix_len:
            alloc.free(new[: res.prefix_len - m.device_prefix_len])
        cache.dec_lock_ref(node)

    def num_nodes(self) -> int:
        return radix_cache_nodes(self.cache)


class Ours:
    def __init__(self, args, policy: str, headroom_frac: float = 0.01, waiting: int = 0) -> None:
        from sgl_multilora.keys import AdapterRef, MatchKey, Namespace
        from sgl_multilora.policy import create_policy
        from sgl_multilora.policy.usage import UsageStats
        from sgl_multilora.pool import UnifiedPool
        from sgl_multilora.residency import AdapterResidency
        from sgl_multilora.swapper import Swapper
        from sgl_multilora.tree import LoraRadixTree

        rng = random.Random(args.seed + 1)
        sizes = {f"a{i}": rng.choice((8, 16, 32, 64)) * BYTES_PER_RANK for i in range(args.adapters)}
        self.now = 0.0
        self.pool = UnifiedPool(args.pool_slots, KV_BYTES_PER_TOKEN)
        self.usage = UsageStats(sizes, KV_BYTES_PER_TOKEN, 27e-6, lambda b: 10e-6 + b / 50e9)
        self.residency = AdapterResidency(self.pool, {a: self.pool.slots_for_bytes(s) for a, s in sizes.items()},
                                          self.usage)
        self.policy = create_policy(policy, context=self.usage)
        self.tree = LoraRadixTree(score=self.policy, clock=lambda: self.now)
        self.swapper = Swapper(self.tree, self.pool, self.residency, self.policy, _InstantLoader(),
                               headroom_frac=headroom_frac)
        self.ns, self.names = Namespace("bench-model"), list(sizes)
        self.refs = [AdapterRef(a) for a in self.names]
        self.match_key = MatchKey
        self.waiting = waiting
        self.queue: deque[tuple[int, list[int], list[int]]] = deque()
        if waiting:
            self.swapper.wanted = lambda: {self.names[a] for a, _, _ in self.queue}

    def step(self, adapter: int, prompt: list[int], full: list[int]) -> None:
        MatchKey = self.match_key
        if self.waiting:
            self.queue.append((adapter, prompt, full))
            if len(self.queue) <= self.waiting:
                return  # the queue fills (the first steps of the warm-up)
            adapter, prompt, full = self.queue.popleft()
            key, ns, refs, queue = MatchKey, self.ns, self.refs, self.queue
            self.swapper.set_waiting(lambda: (key(ns, refs[a], p) for a, p, _ in queue))
        self.now += 0.01
        name, sw, tree, pool = self.names[adapter], self.swapper, self.tree, self.pool
        self.usage.record_request(name, self.now)
        self.usage.record_batch(self.now, 1)
        sw.tick(self.now)
        if not self.residency.is_resident(name):
            assert sw.load(name), "the bench pool cannot hold its adapters"
            sw.poll_loads()
        self.residency.acquire(name)
        m = tree.match(MatchKey(self.ns, self.refs[adapter], prompt))
        tree.lock(m.last_node)
        need = len(full) - m.prefix_len
        if not pool.can_fit(need):
            assert sw.make_room(need, protect=name), "nothing left to evict"
        new = pool.alloc("kv_running", need).ids()
        res = tree.insert(MatchKey(self.ns, self.refs[adapter], full), m.kv_values + new)
        dup = res.prefix_len - m.prefix_len
        if dup:
            pool.release("kv_running", new[:dup])
        pool.move("kv_running", "kv_cached", new[dup:])
        tree.unlock(m.last_node)
        self.residency.release(name)

    def num_nodes(self) -> int:
        return self.tree.stats().num_kv_nodes

    @property
    def num_evict_calls(self) -> int:
        return self.tree.stats().num_evicted_runs

    def check(self) -> None:
        self.tree.check_invariants()
        self.swapper.check_invariants()
        assert self.pool.num_of("kv_cached") == self.tree.total_len()


class _InstantLoader:
    def start(self, adapter_id, slots) -> None:
        pass

    def is_done(self, adapter_id) -> bool:
        return True


def make_ours(args, arm: str) -> Ours:
    """`ours:<policy>[:headroom=<fraction>][:waiting=<requests>]`; raises ValueError for another form."""
    parts = arm.split(":")
    options = dict(p.split("=", 1) for p in parts[2:] if "=" in p)
    if parts[0] != "ours" or len(parts) < 2 or len(options) != len(parts) - 2 or set(options) - {"headroom", "waiting"}:
        raise ValueError(f"unknown arm {arm!r}: stock or ours:<policy>[:headroom=<fraction>][:waiting=<requests>]")
    return Ours(args, parts[1], float(options.get("headroom", 0.01)), int(options.get("waiting", 0)))


def measure(arm, args) -> dict:
    steps = stream(args)
    warm = full_at = 0
    for warm, (a, prompt, full) in enumerate(steps, 1):
        arm.step(a, prompt, full)
        if not full_at and arm.num_evict_calls:
            full_at = warm
        if full_at and warm - full_at >= args.warmup:
            break
    nodes_at_start = arm.num_nodes()
    if isinstance(arm, Ours):
        arm.check()  # correctness before timing: every count adds up after the warm-up
    gc.collect()  # both arms start timing with the same garbage collector state
    times = []
    for _, (a, prompt, full) in zip(range(args.steps), steps):
        start = time.perf_counter()
        arm.step(a, prompt, full)
        times.append(time.perf_counter() - start)
    times.sort()
    return {"warmup_steps": warm, "pool_full_at_step": full_at, "nodes_at_start": nodes_at_start, "nodes_at_end": arm.num_nodes(),
            "mean_ms": statistics.fmean(times) * 1e3, "p50_ms": times[len(times) // 2] * 1e3,
            "p99_ms": times[int(len(times) * 0.99)] * 1e3, "max_ms": times[-1] * 1e3}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--warmup", type=int, default=20000, help="steps run after the pool first fills")
    ap.add_argument("--conversations", type=int, default=4000)
    ap.add_argument("--adapters", type=int, default=100)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--max-turns", type=int, default=8)
    ap.add_argument("--pool-slots", default="900000",
                    help="comma-separated pool sizes (slots); 900,000 gives about 10k tree nodes in steady state")
    ap.add_argument("--arms", default=DEFAULT_ARMS,
                    help="stock, ours:<policy>[:headroom=<fraction of the pool>][:waiting=<queued requests>] "
                         "(default headroom 0.01, no queue)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("eval/results/pool_cost/pool_cost.jsonl"))
    args = ap.parse_args(argv)

    arms = args.arms.split(",")
    sizes = [int(x) for x in str(args.pool_slots).split(",")]
    lines = ["| pool slots | arm | mean ms/step, median (min-max) | p50 | p99 | ratio to stock (per repeat) | "
             "nodes at start |", "|---:|---|---:|---:|---:|---:|---:|"]
    for size in sizes:
        run_args = argparse.Namespace(**{**vars(args), "pool_slots": size})
        load_at_start = os.getloadavg()
        runs: dict[str, list[dict]] = {arm: [] for arm in arms}
        for r in range(args.repeats):
            for arm in arms[r % len(arms):] + arms[:r % len(arms)]:  # rotate so load drifts hit all arms
                obj = Stock(run_args) if arm == "stock" else make_ours(run_args, arm)
                runs[arm].append(measure(obj, run_args))
                if arm != "stock":
                    obj.check()  # and after it
        med = {arm: statistics.median(x["mean_ms"] for x in rs) for arm, rs in runs.items()}
        ratios = {arm: [a["mean_ms"] / b["mean_ms"] for a, b in zip(rs, runs["stock"])] for arm, rs in runs.items()} \
            if "stock" in runs else {}
        record = {
            "setup": {**{k: v for k, v in vars(args).items() if k != "out"}, "pool_slots": size},
            "device": {"processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
                       "python": platform.python_version(), "load_avg_start": load_at_start,
                       "load_avg_end": os.getloadavg()},
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "measurements": {
                "per_step_ms_median": med,
                "per_step_ms_range": {arm: [min(x["mean_ms"] for x in rs), max(x["mean_ms"] for x in rs)]
                                      for arm, rs in runs.items()},
                "ratio_to_stock_per_repeat": ratios,
                "all_runs": runs,
                "statistic": f"per arm, median (min-max) over {args.repeats} repeats of the mean step time; ratios "
                             "pair each arm with stock's run of the same repeat",
            },
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")
        for arm, rs in runs.items():
            rng = record["measurements"]["per_step_ms_range"][arm]
            rt = ratios.get(arm, [])
            lines.append(
                f"| {size} | {arm} | {med[arm]:.3f} ({rng[0]:.3f}-{rng[1]:.3f}) | "
                f"{statistics.median(x['p50_ms'] for x in rs):.3f} | {statistics.median(x['p99_ms'] for x in rs):.3f} "
                f"| {statistics.median(rt):.2f} ({min(rt):.2f}-{max(rt):.2f}) | "
                f"{statistics.median(x['nodes_at_start'] for x in rs):.0f} |" if rt else f"| {size} | {arm} | "
                f"{med[arm]:.3f} | | | | |")
        print("\n".join(lines), flush=True)
    args.out.with_suffix(".md").write_text(
        f"# Per-step cost of the memory system vs SGLang's RadixCache ({datetime.date.today()})\n\n"
        f"Command: `.venv/bin/python -m eval.bench.pool_cost --pool-slots {args.pool_slots} --repeats {args.repeats}"
        f"{'' if args.arms == DEFAULT_ARMS else f' --arms {args.arms}'}"
        f"{'' if args.out.name == 'pool_cost.jsonl' else f' --out {args.out}'}` "
        f"({args.adapters} adapters, {args.conversations} conversations, {args.steps} timed steps after the pool "
        f"fills and {args.warmup} more warm-up steps). Machine: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, load average at end {os.getloadavg()[0]:.2f}.\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

"""`GET /multilora/metrics`: the figures of `/multilora/stats` in Prometheus' text format, for a scrape job.

Lives here: `prometheus_text(trees, memory)`, pure: the per-scheduler dicts `/multilora/stats` returns in, the
exposition text out (prometheus_client's own writer). Not here: reading them from the schedulers
(`patches/stats.py`, which serves both routes). SGLang's `/metrics` (with `--enable-metrics`) is SGLang's own
registry, written by its processes; these figures live in the scheduler's objects and are read on each scrape, so
they sit on a path of their own: scrape both.

Every series has a `rank` label (the scheduler's index). Gauges: KV slots by state, requests running / waiting,
loaded adapters, the unified pool's bytes by kind, resident / registered adapters, invalid KV slots, the tree's
tokens, the multi-queue's queued requests. Counters (`_total`): tree matches, hits and reused tokens by kind,
evictions and evicted slots by kind, adapter loads by cause, refused loads, starvation holds and stalls (the
admission watchdog's; a gauge says how long the current one has lasted).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

PREFIX = "sgl_multilora"


def prometheus_text(trees: Sequence[dict | None], memory: Sequence[dict | None], tiers: dict | None = None) -> str:
    """Prometheus exposition text of the per-scheduler tree stats (`TreeStats` as a dict, or None without the
    tree) and memory views (`patches/stats.py`'s, or None), and of the HTTP process's adapter tiers
    (`patches/on_demand.py`'s snapshot, or None). Absent figures give no sample."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(trees, memory, tiers))
    return generate_latest(registry).decode()


class _Collector:
    def __init__(self, trees: Sequence[dict | None], memory: Sequence[dict | None], tiers: dict | None) -> None:
        self.trees, self.memory, self.tiers = trees, memory, tiers

    def describe(self):
        return []

    def collect(self) -> Iterable:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        families: dict[str, object] = {}

        def add(kind, name: str, doc: str, labels: dict[str, str], value) -> None:
            if value is None:
                return
            family = families.get(name)
            if family is None:
                family = families[name] = kind(f"{PREFIX}_{name}", doc, labels=list(labels))
            family.add_metric(list(labels.values()), float(value))

        def gauge(name, doc, labels, value):
            add(GaugeMetricFamily, name, doc, labels, value)

        def counter(name, doc, labels, value):
            add(CounterMetricFamily, name, doc, labels, value)

        for rank, m in enumerate(self.memory):
            if not m:
                continue
            r = {"rank": str(rank)}
            for state in ("total", "free", "cache_evictable", "cache_protected"):
                gauge("kv_slots", "KV token slots by state", {**r, "state": state}, m.get(state))
            for state in ("running", "waiting"):
                gauge("requests", "Requests running or waiting in the scheduler", {**r, "state": state},
                      m.get(state))
            gauge("adapters_loaded", "LoRA adapters loaded", r, (m.get("adapters") or {}).get("loaded"))
            pool = m.get("unified_pool")
            if pool:
                for kind, value in (pool.get("bytes") or {}).items():
                    gauge("pool_bytes", "Unified pool bytes by kind", {**r, "kind": kind}, value)
                adapters = pool.get("adapters") or {}
                gauge("adapters_resident", "Adapters resident in the pool", r, adapters.get("resident"))
                gauge("adapters_registered", "Adapters with a host copy", r, adapters.get("registered"))
                swapper = pool.get("swapper") or {}
                gauge("invalid_kv_slots", "Cached KV slots of adapters not resident (0 by the dependency rule)",
                      r, swapper.get("invalid_kv_slots"))
                for kind in ("kv", "adapter"):
                    counter("evictions", "Pool evictions by kind", {**r, "kind": kind},
                            swapper.get(f"{kind}_evictions"))
                    counter("evicted_slots", "Slots freed by pool evictions, by kind", {**r, "kind": kind},
                            swapper.get(f"{kind}_evicted_slots"))
                by_age = swapper.get("kv_evicted_slots_by_age") or ()
                for age, value in zip(("under_1s", "1_10s", "10_60s", "over_60s"), by_age):
                    counter("kv_evicted_slots_by_age", "KV slots evicted, by how long they had been unused", {
                        **r, "age": age}, value)
                for cause, key in (("demand", "adapter_loads"), ("prefetch", "prefetches")):
                    counter("adapter_loads", "Adapter copies into the pool, by cause", {**r, "cause": cause},
                            swapper.get(key))
                counter("refused_loads", "Adapter loads refused for fragmented slots", r,
                        swapper.get("refused_loads"))
                counter("unreachable_runs", "Refused loads no eviction could give one run (nothing evicted)", r,
                        swapper.get("unreachable_runs"))
                admission = pool.get("admission") or {}
                counter("admission_holds", "Starvation holds: a request memory kept out too long goes first", r,
                        admission.get("starvation_holds"))
                counter("admission_stalls", "Stalls: requests waiting with nothing running for the watchdog's "
                        "threshold", r, admission.get("stalls"))
                gauge("admission_stalled_seconds", "How long the current stall has lasted (0: none)", r,
                      admission.get("stalled_s"))
            sched = m.get("scheduler")
            if sched:
                gauge("queued_requests", "Requests in the multi-queue scheduler's queues", r, sched.get("num_queued"))
        for rank, t in enumerate(self.trees):
            if not t:
                continue
            r = {"rank": str(rank)}
            counter("tree_matches", "Prefix matches in the LoRA-aware tree", r, t.get("num_matches"))
            for kind, value in (t.get("hits") or {}).items():
                counter("tree_hits", "Matches that reused KV, by kind", {**r, "kind": kind}, value)
            for kind, value in (t.get("hit_tokens") or {}).items():
                counter("tree_hit_tokens", "Tokens of KV reused, by kind", {**r, "kind": kind}, value)
            gauge("tree_tokens", "KV tokens the tree holds", r, t.get("total_len"))
            counter("tree_evicted_tokens", "KV tokens the tree evicted", r, t.get("num_evicted_tokens"))
        if self.tiers:
            source, host = self.tiers.get("source") or {}, self.tiers.get("host") or {}
            for outcome in ("loads", "refused", "failed_loads"):
                counter("source_adapters", "Adapters asked of the sources on a first request, by outcome",
                        {"outcome": outcome}, source.get(outcome))
            for phase in ("resolve", "read", "load"):
                counter("source_load_seconds", "Seconds spent bringing adapters in from the sources, by phase",
                        {"phase": phase}, source.get(f"{phase}_s"))
            gauge("host_adapters", "Adapters with a host copy", {}, host.get("adapters"))
            gauge("host_adapter_bytes", "Bytes of the adapters' host copies (weight files)", {}, host.get("bytes"))
            counter("host_adapter_hits", "Adapter names of requests already loaded", {}, host.get("hits"))
            counter("host_adapter_drops", "Host copies dropped for the budget", {}, host.get("drops"))
        return list(families.values())

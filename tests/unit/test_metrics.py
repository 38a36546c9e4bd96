"""`/multilora/metrics` (`sgl_multilora/metrics.py`): the `/multilora/stats` figures as Prometheus text, read back
with prometheus_client's own parser (the oracle for the format)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from sgl_multilora.metrics import prometheus_text

MEMORY = {
    "total": 6000, "free": 2000, "cache_evictable": 3500, "cache_protected": 500, "running": 2, "waiting": 3,
    "adapters": {"loaded": 24},
    "unified_pool": {
        "bytes": {"adapter_weights": 100, "cached_kv": 200, "running_kv": 300, "in_flight": 0, "free": 400},
        "adapters": {"registered": 24, "resident": 7, "loading": 1},
        "swapper": {"kv_evictions": 5, "kv_evicted_slots": 50, "adapter_evictions": 2, "adapter_evicted_slots": 20,
                    "adapter_loads": 9, "prefetches": 4, "refused_loads": 1, "invalid_kv_slots": 0,
                    "kv_evicted_slots_by_age": [30, 15, 5, 0]},
        "admission": {"starvation_holds": 2, "stalls": 1, "stalled_s": 6.5},
    },
    "scheduler": {"num_queued": 3},
}
TREE = {"num_matches": 10, "hits": {"base": 4, "alora_base_prefix": 2}, "hit_tokens": {"base": 400,
        "alora_base_prefix": 120}, "total_len": 3500, "num_evicted_tokens": 77}


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_every_figure_is_a_sample_with_its_rank():
    got = samples(prometheus_text([TREE, None], [MEMORY, None]))
    r = (("rank", "0"),)
    assert got[("sgl_multilora_kv_slots", (*r, ("state", "total")))] == 6000
    assert got[("sgl_multilora_kv_slots", (*r, ("state", "cache_protected")))] == 500
    assert got[("sgl_multilora_requests", (*r, ("state", "waiting")))] == 3
    assert got[("sgl_multilora_adapters_loaded", r)] == 24
    pool = {labels: v for (name, labels), v in got.items() if name == "sgl_multilora_pool_bytes"}
    assert sum(pool.values()) == 1000 and len(pool) == 5
    assert got[("sgl_multilora_adapters_resident", r)] == 7
    assert got[("sgl_multilora_evictions_total", (("kind", "adapter"), *r))] == 2
    assert got[("sgl_multilora_evicted_slots_total", (("kind", "kv"), *r))] == 50
    assert got[("sgl_multilora_adapter_loads_total", (("cause", "prefetch"), *r))] == 4
    assert got[("sgl_multilora_kv_evicted_slots_by_age_total", (("age", "under_1s"), *r))] == 30
    assert got[("sgl_multilora_kv_evicted_slots_by_age_total", (("age", "over_60s"), *r))] == 0
    assert got[("sgl_multilora_refused_loads_total", r)] == 1
    assert got[("sgl_multilora_invalid_kv_slots", r)] == 0
    assert got[("sgl_multilora_queued_requests", r)] == 3
    assert got[("sgl_multilora_admission_holds_total", r)] == 2
    assert got[("sgl_multilora_admission_stalls_total", r)] == 1
    assert got[("sgl_multilora_admission_stalled_seconds", r)] == 6.5
    assert got[("sgl_multilora_tree_hit_tokens_total", (("kind", "alora_base_prefix"), *r))] == 120
    assert got[("sgl_multilora_tree_evicted_tokens_total", r)] == 77
    assert not [k for k in got if ("rank", "1") in k[1]], "the second scheduler reported nothing"


def test_counters_are_typed_as_counters_and_gauges_as_gauges():
    types = {f.name: f.type for f in text_string_to_metric_families(prometheus_text([TREE], [MEMORY]))}
    assert types["sgl_multilora_evictions"] == "counter" and types["sgl_multilora_tree_hits"] == "counter"
    assert types["sgl_multilora_pool_bytes"] == "gauge" and types["sgl_multilora_kv_slots"] == "gauge"


def test_a_server_without_the_tree_or_the_pool_reports_what_it_has():
    plain = {k: v for k, v in MEMORY.items() if k not in ("unified_pool", "scheduler")}
    got = samples(prometheus_text([None], [plain]))
    assert got[("sgl_multilora_kv_slots", (("rank", "0"), ("state", "free")))] == 2000
    assert not [k for k in got if k[0].startswith(("sgl_multilora_pool", "sgl_multilora_tree"))]
    assert prometheus_text([], []) == ""


def test_the_adapter_tiers_are_samples_of_their_own():
    tiers = {"sources": ["/src"], "source": {"refused": 2, "loads": 3, "failed_loads": 1,
                                             "resolve_s": 0.01, "read_s": 0.02, "load_s": 0.5, "last_load": {}},
             "host": {"adapters": 2, "resident": ["a", "b"], "bytes": 4096, "budget_bytes": 10_000, "hits": 7,
                      "drops": 1, "loads_in_flight": 0}}
    text = prometheus_text([], [], tiers)
    got = samples(text)
    assert got[("sgl_multilora_source_adapters_total", (("outcome", "refused"),))] == 2
    assert got[("sgl_multilora_source_load_seconds_total", (("phase", "load"),))] == 0.5
    assert got[("sgl_multilora_host_adapter_bytes", ())] == 4096
    assert got[("sgl_multilora_host_adapter_drops_total", ())] == 1
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert types["sgl_multilora_host_adapters"] == "gauge" and types["sgl_multilora_host_adapter_hits"] == "counter"

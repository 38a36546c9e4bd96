"""The tree-overhead bench (`eval/bench/tree_overhead.py`) on a tiny stream whose working set is several times its
KV pool: eviction runs in every arm, and afterwards every slot is accounted for, no lock is left and our tree's
invariants hold; the bench's own record and report come out."""

from __future__ import annotations

import json

import pytest

from eval.bench import tree_overhead

TINY = ["--kv-tokens", "3000", "--requests", "50", "--warmup", "50", "--conversations", "30", "--adapters", "4",
        "--length-divisor", "16", "--max-history", "256", "--repeats", "1"]
ARMS = ("stock", "ours", "ours:unified")


@pytest.fixture(scope="module")
def drivers():
    """Each arm driven once through the tiny stream: {arm: (args, stream, driver, first eviction at)}."""
    from eval.bench.tree_overhead_arms import registered_adapters, setup_sglang

    setup_sglang()
    args = tree_overhead.parse_args(TINY)
    stream = tree_overhead.build_stream(args)
    lora_ids = [f"{i:032x}" for i in range(args.adapters)]
    with registered_adapters(lora_ids, [8, 8, 16, 32]):
        driven = tree_overhead.drive(list(ARMS), 3000, stream, lora_ids, args)
    return {arm: (args, stream, driver, first) for arm, (driver, first) in driven.items()}


@pytest.mark.parametrize("arm", ARMS)
def test_eviction_runs_and_every_slot_is_accounted_for(drivers, arm):
    args, stream, driver, first_eviction_at = drivers[arm]
    assert sum(len(full) for _, _, full in stream) > 4 * 3000, "the tiny stream must not fit in the pool"
    assert first_eviction_at is not None and driver.evictions()["kv_tokens"] > 0
    acc = driver.accounting()
    assert acc["available"] + acc["tree_tokens"] + acc["adapter_slots"] == 3000, acc
    assert acc["tree_tokens"] > 0 and driver.req_pool.available_size() == args.window
    assert driver.num_locked_nodes() == 0 and driver.cache.protected_size() == 0
    if arm == "ours:unified":
        assert acc["adapter_slots"] > 0 and driver.evictions()["adapter_loads"] > 0
        assert driver.allocator.pool.num_of("kv_running") == 0
    if arm != "stock":
        driver.cache.check_invariants()
    assert all(s > 0 for s in driver.seconds), "every request did some timed cache work"
    assert driver.prompt_tokens > driver.hit_tokens > 0


def test_ours_caches_what_stock_caches(drivers):
    """Same keys (adapter = namespace), same LRU order: the hits agree to within a few percent."""
    hits = {arm: drivers[arm][2].hit_tokens for arm in ("stock", "ours")}
    assert abs(hits["ours"] - hits["stock"]) <= 0.05 * hits["stock"], hits


def test_main_writes_its_record_and_report(tmp_path):
    out = tmp_path / "tree_overhead.jsonl"
    record = tree_overhead.main([*TINY, "--out", str(out)])
    (line,) = out.read_text().splitlines()
    assert json.loads(line)["sizes"][0]["kv_tokens"] == 3000
    (size,) = record["sizes"]
    assert set(size["summary"]) == set(ARMS)
    report = out.with_suffix(".md").read_text()
    assert "| 3000 | ours:unified |" in report and "hit tokens vs stock" in report

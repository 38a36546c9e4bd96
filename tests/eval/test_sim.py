"""The GPU-scale simulator: latency model against hand-computed figures, exact memory accounting at every step,
the dependency invariant, invalid KV, history and aLoRA reuse, the host KV tier, determinism and bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eval.sim.engine import SimConfig, simulate
from eval.sim.latency import LatencyModel
from eval.sim.memory import pool_bytes
from eval.sim.systems.request import NS
from eval.workloads.chatbot import ChatbotParams, generate
from eval.workloads.records import AdapterInfo, Request
from sgl_multilora.pool import ExceedsPoolError, UnifiedPool
from sgl_multilora.tree_nodes import NodeKind

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ARMS = ["vllm", "slora", "sglang", "ours:elora", "ours:lru", "ours:chameleon", "ours:elora:no-tree",
        "ours:elora:-visit"]
LAT = LatencyModel()
KVB = 131072
HBM = 3.35e12 * 0.85
FLOPS = 989.5e12 * 0.6


def req(rid, t, new, out, adapter=None, parent=None, history=0, session="s", turn=0, alora=False):
    return Request(rid, t, session, turn, adapter, parent, history, new, out, alora_invocation=alora)


def chat(num_conversations=30, num_adapters=6, seed=0, rank=(8, 16), modules=("q_proj", "v_proj")):
    w = generate(ChatbotParams(num_conversations=num_conversations, num_adapters=num_adapters, ranks=rank,
                               conversation_rate=2.0, think_time_s=4.0, mean_turns=3.0, mean_new_tokens=40.0,
                               mean_output_tokens=12.0, system_tokens=16), seed)
    return tuple(AdapterInfo(a.name, a.rank, a.kind, modules) for a in w.adapters), w.requests


# ---- latency and memory models ---------------------------------------------------------------------------

def test_latency_model_hand_computed():
    # decode of one token at empty context: reading 16.06 GB of weights at 85% of 3.35 TB/s
    assert LAT.step_time(0, 0, 1, 0) == pytest.approx(16.06e9 / HBM, rel=1e-12)
    assert LAT.step_time(0, 0, 1, 0) == pytest.approx(5.6400e-3, rel=1e-4)
    # + 1000 tokens of context: 1000 x 128 KiB more
    assert LAT.step_time(0, 0, 1, 1000) == pytest.approx((16.06e9 + 1000 * KVB) / HBM, rel=1e-12)
    # prefill of 4096 tokens: compute-bound linear layers + causal attention (4 * 32 * 4096 per pair)
    pairs = 4096 * 4097 / 2
    expect = 4096 * 2 * 8.03e9 / FLOPS + 4 * 32 * 4096 * pairs / FLOPS
    assert LAT.prefill_time(4096) == pytest.approx(expect, rel=1e-12)
    assert LAT.prefill_time(4096) == pytest.approx(0.11821, rel=1e-3)
    assert LAT.recompute_s_per_token() == pytest.approx(27e-6, rel=0.01)  # perf-anchors 5: ~27 us at 60% MFU
    # the roofline LoRA estimate: launch floor + weight and activation traffic
    roof = LatencyModel(lora_cost="roofline")
    batch = [(2, 16, frozenset({"qkv"}), 100_000_000), (0, 64, frozenset({"qkv"}), 7)]  # no tokens: not read
    lora = roof.step_time(0, 0, 2, 0, batch) - roof.step_time(0, 0, 2, 0)
    assert lora == pytest.approx(256 * 4e-6 + (100e6 + 2 * 7.2e6) / HBM, rel=1e-12)
    assert LAT.step_time(0, 0, 0, 0) == 0.0
    assert LAT.lora_time([(0, 16, frozenset({"qkv"}), 1)]) == 0.0
    with pytest.raises(ValueError, match="unknown lora_cost 'guess'"):
        LatencyModel(lora_cost="guess")


def test_adapter_sizes_and_copies_match_published_figures():
    assert LAT.model.adapter_bytes(32, ("q_proj", "k_proj", "v_proj", "o_proj")) == 54_525_952  # 54.5 MB
    assert LAT.model.adapter_bytes(64, ALL) == 335_544_320  # perf-anchors 2.2: 335.5 MB
    assert LAT.h2d_time(335_544_320) == pytest.approx(6.71e-3 + 10e-6, rel=1e-3)  # 6.71 ms at 50 GB/s
    assert LAT.model.kv_bytes_per_token == KVB
    with pytest.raises(ValueError, match="unknown target modules"):
        LAT.model.adapter_bytes(8, ("qkv_proj",))
    assert pool_bytes(LAT) == int(81_559 * 2**20 * 0.88) - 16_060_000_000


def test_systems_count_memory_in_core_pool_slots():
    """Every area is a core pool of token-sized slots (counts only); adapters take their own size in slots,
    rounded up, except in the SGLang-like system, which pads every adapter to the largest."""
    from eval.sim.systems import create_system

    ads = (AdapterInfo("small", 3, target_modules=("q_proj", "v_proj")), AdapterInfo("big", 64, "lora", ALL))
    total = 30_000 * KVB + 5  # rounded down to whole slots
    small = 20  # rank 3 x (4096 + 4096 + 4096 + 1024) x 32 layers x 2 B = 19.5 slots of 128 KiB, rounded up
    assert LAT.model.adapter_bytes(3, ("q_proj", "v_proj")) == 19.5 * KVB
    ours = create_system("ours:elora", ads, LAT, total)
    assert set(ours.pools) == {"all"} and isinstance(ours.kv_pool, UnifiedPool)
    assert ours.kv_pool.num_slots == 30_000 and not ours.kv_pool.track_ids
    assert ours.residency.entry("small").num_slots == small
    assert ours.residency.entry("big").num_slots == 335_544_320 // KVB == 2560
    vllm = create_system("vllm", ads, LAT, total)
    assert {a: p.num_slots for a, p in vllm.pools.items()} == {"adapter": 6000, "kv": 24_000}
    sglang = create_system("sglang", ads, LAT, total)
    assert sglang.residency.entry("small").num_slots == 2560
    assert {a: p.num_slots for a, p in sglang.pools.items()} == {"slots": 2 * 2560, "kv": 30_000 - 5120}
    with pytest.raises(ExceedsPoolError, match="adapter 'big' needs 2560 slots .* holds 2000 slots"):
        create_system("vllm", ads, LAT, 10_000 * KVB)  # 20% of 10k slots cannot hold 'big'



# ---- timelines against hand computation ------------------------------------------------------------------

def test_single_request_timeline_hand_computed():
    run = simulate("ours:elora", (), [req("r", 1.0, 1000, 3)])
    r = run.results[0]
    prefill = 1000 * 2 * 8.03e9 / FLOPS + 4 * 32 * 4096 * (1000 * 1001 / 2) / FLOPS
    decode1 = (16.06e9 + 1001 * KVB) / HBM
    decode2 = (16.06e9 + 1002 * KVB) / HBM
    assert r.ttft_s == pytest.approx(prefill, rel=1e-12)
    assert r.e2e_s == pytest.approx(prefill + decode1 + decode2, rel=1e-12)
    assert r.tpot_s == pytest.approx((decode1 + decode2) / 2, rel=1e-12)
    assert r.cached_tokens == 0 and r.extra["simulated"] is True


@pytest.mark.parametrize("arm,reused", [("vllm", True), ("sglang", True), ("ours:elora", True),
                                        ("slora", False)])
def test_second_turn_reuses_history(arm, reused):
    ads = (AdapterInfo("a", 16),)
    reqs = [req("t0", 0.0, 300, 50, "a"), req("t1", 5.0, 40, 10, "a", parent="t0", history=350, turn=1)]
    run = simulate(arm, ads, reqs, config=SimConfig(check_every_step=True))
    t1 = next(r for r in run.results if r.rid == "t1")
    assert t1.cached_tokens == (350 if reused else 0)


def test_follow_up_turn_waits_for_its_parent():
    ads = (AdapterInfo("a", 16),)
    reqs = [req("t0", 0.0, 300, 400, "a"), req("t1", 0.5, 40, 10, "a", parent="t0", history=700, turn=1)]
    run = simulate("vllm", ads, reqs)
    t0, t1 = sorted(run.results, key=lambda r: r.rid)
    assert t1.extra["submit_s"] == pytest.approx(t0.arrival_s + t0.e2e_s) and t1.cached_tokens == 700


def test_alora_check_reads_base_prefix_only_in_ours():
    ads = (AdapterInfo("check", 32, kind="alora"),)
    reqs = [req("base", 0.0, 500, 100), req("chk", 5.0, 5, 5, "check", parent="base", history=600, turn=1,
                                          alora=True)]
    for arm, cached in [("ours:elora", 600), ("vllm", 0), ("sglang", 0)]:
        run = simulate(arm, ads, reqs, config=SimConfig(check_every_step=True))
        assert next(r for r in run.results if r.rid == "chk").cached_tokens == cached, arm


# ---- accounting, determinism, dependency, invalid KV ----------------------------------------------------

@pytest.mark.parametrize("arm", ARMS)
def test_memory_accounting_exact_every_step(arm):
    ads, reqs = chat()
    total = 3814 * KVB  # small enough to evict: ~3.8k tokens of KV (500 MB)
    run = simulate(arm, ads, reqs, config=SimConfig(check_every_step=True, pool_bytes=total))
    assert len(run.results) == len(reqs)
    for s in run.samples:  # every sample adds up, independently of the system's own checker
        assert s["free"] + s["adapter"] + s["kv_cached"] + s["kv_running"] + s["in_flight"] == total
    if arm != "slora":
        assert run.system.tree.stats().num_evicted_tokens > 0, "the pool never filled: the test is too easy"


def test_sglang_hicache_baseline_copies_back_with_the_same_host_budget():
    """Stock SGLang with its hierarchical cache: the same host tier object as ours, the same budget; evicted history
    comes back by copy instead of recomputation, and its accounting closes at every step."""
    ads, reqs = chat(seed=3)
    cfg = SimConfig(pool_bytes=500_000_000, host_kv_bytes=60_000_000, check_every_step=True)
    plain = simulate("sglang", ads, reqs, config=cfg)
    hicache = simulate("sglang:hicache", ads, reqs, config=cfg)
    assert plain.system.host is None and hicache.system.host.capacity_bytes <= 60_000_000
    assert hicache.summary["num_kv_restores"] > 0 and hicache.summary["kv_host_hit_rate"] > 0
    assert plain.summary["kv_host_hit_rate"] == 0
    assert hicache.summary["history_recompute_share"] < plain.summary["history_recompute_share"]
    assert len(hicache.results) == len(reqs)
    with pytest.raises(ValueError, match="unknown suffix"):
        simulate("sglang:hicache:lru", ads, reqs, config=cfg)


def test_deterministic_for_a_seed():
    ads, reqs = chat(seed=3)
    cfg = SimConfig(pool_bytes=500_000_000, host_kv_bytes=60_000_000)
    a = simulate("ours:elora", ads, reqs, config=cfg)
    b = simulate("ours:elora", ads, reqs, config=cfg)
    assert [json.dumps(r.to_json()) for r in a.results] == [json.dumps(r.to_json()) for r in b.results]
    assert a.samples == b.samples and a.summary == b.summary
    assert a.summary["num_kv_restores"] > 0 and a.system.host.counters.dropped_tokens > 0  # both tiers at work
    other = chat(seed=4)[1]
    assert [r.arrival_s for r in other] != [r.arrival_s for r in reqs]


_RUN_SNIPPET = """
import json, sys
sys.path.insert(0, ".")
from tests.eval.test_sim import chat
from eval.sim.engine import SimConfig, simulate
ads, reqs = chat(num_conversations=40, num_adapters=24, rank=(64,), seed=1,
                 modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
run = simulate("ours:elora", ads, reqs, config=SimConfig(pool_bytes=3_000_000_000))
print(json.dumps([r.to_json() for r in run.results], sort_keys=True))
"""


def test_deterministic_across_processes():
    """Set iteration order (hash seeds, object addresses) must not leak into eviction order."""
    import os
    import subprocess
    import sys

    outs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run([sys.executable, "-c", _RUN_SNIPPET], capture_output=True, text=True, env=env,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))), timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        outs.append(proc.stdout)
    assert outs[0] == outs[1] and len(outs[0]) > 1000


def _invalid_tokens_by_walk(system) -> int:
    """Brute force: KV tokens below adapter nodes (and aLoRA suffixes) whose adapter is not resident."""
    ns_node = system.tree.namespace_node(NS)
    total = 0
    for identity, top in ns_node.children.items():
        if identity is None or system.residency.is_resident(identity):
            continue
        stack = list(top.children.values()) + list(top.dependents)
        while stack:
            node = stack.pop()
            total += len(node.key)
            stack.extend(node.children.values())
    return total


def test_dependency_tree_keeps_invalid_kv_at_zero_and_no_tree_does_not():
    # 24 rank-64 all-linear adapters (336 MB each) and a 3 GB pool: adapters must leave while KV stays
    ads, reqs = chat(num_conversations=40, num_adapters=24, rank=(64,), modules=ALL, seed=1)
    cfg = SimConfig(pool_bytes=3_000_000_000, check_every_step=True)
    ours = simulate("ours:elora", ads, reqs, config=cfg)
    loose = simulate("ours:elora:no-tree", ads, reqs, config=cfg)
    assert all(s["invalid_kv"] == 0 for s in ours.samples)
    assert _invalid_tokens_by_walk(ours.system) == 0
    for node in ours.system.tree.namespace_node(NS).children.values():  # adapter node <=> resident
        if node.kind is NodeKind.ADAPTER:
            assert ours.system.residency.is_resident(node.label.identity)
    assert max(s["invalid_kv"] for s in loose.samples) > 0 and loose.summary["invalid_kv_share"] > 0
    assert _invalid_tokens_by_walk(loose.system) * KVB == loose.system.invalid_kv_bytes()


# ---- bad input --------------------------------------------------------------------------------------------

def test_bad_input_is_named():
    ads = (AdapterInfo("a", 16),)
    with pytest.raises(ValueError, match="r1 names adapter 'b'"):
        simulate("vllm", ads, [req("r1", 0.0, 10, 2, "b")])
    with pytest.raises(ValueError, match="history_tokens 5"):
        simulate("vllm", ads, [req("r0", 0.0, 10, 2), req("r1", 1.0, 3, 2, parent="r0", history=5)])
    with pytest.raises(ValueError, match="unknown arm"):
        simulate("tgi", ads, [req("r0", 0.0, 10, 2)])
    with pytest.raises(ValueError, match="unknown suffix"):
        simulate("ours:lru:-cost", ads, [req("r0", 0.0, 10, 2)])
    with pytest.raises(RuntimeError, match="request big can never be admitted"):
        simulate("ours:lru", ads, [req("big", 0.0, 5000, 10, "a")], config=SimConfig(pool_bytes=300_000_000))


def _table_cell(md: str, row: str, column: int) -> str:
    """Cell `column` (0 = the row's name) of the Markdown table row whose name is `row`."""
    line = next(x for x in md.splitlines() if x.startswith(f"| {row} |"))
    return line.strip("|").split("|")[column].strip()


def test_compare_writes_results(tmp_path):
    """A small sweep: the files hold every run, and the report's ratios and verdicts are the ones
    its run records give (recomputed here from <out>_runs.jsonl, not by the report's code)."""
    from eval.sim.compare import main
    from eval.sim.findings import ABLATION_NAMES, NEGLIGIBLE, ORDER_ONLY

    out = tmp_path / "sim_small"
    main(["--num-adapters", "4", "--rates", "1,2", "--window-s", "6", "--mean-new-tokens", "40",
          "--seeds", "0,1", "--out", str(out)])
    md = (tmp_path / "sim_small.md").read_text()
    assert (tmp_path / "sim_small.png").read_bytes().startswith(b"\x89PNG") and "`sim_small.png`" in md
    runs = [json.loads(line) for line in open(f"{out}_runs.jsonl")]
    assert len(runs) == 2 * (2 * 6 + 2 * 11) and all(r["device"].startswith("simulated") for r in runs)
    ttft = {(r["setup"]["seed"], r["setup"]["conversation_rate"], r["setup"]["arm"]): r["summary"]["ttft_mean_s"]
            for r in runs}

    rates = [1.0, 2.0]
    per_seed = []
    for seed in (0, 1):
        # matched rates: both arms under the 0.5 s SLO up to the rate, the lower knee of the two
        knee = min(max([r for r in rates if ttft[(seed, r, arm)] < 0.5] or [0.0]) for arm in ("ours:elora", "vllm"))
        got = [1 - ttft[(seed, r, "ours:elora")] / ttft[(seed, r, "vllm")] for r in rates if r <= knee]
        if got:
            per_seed.append(sum(got) / len(got))
    cell = _table_cell(md, "mean TTFT vs vLLM", 2)
    assert cell.split(" ")[0] == (f"{-100 * float(np.median(per_seed)):+.1f}%" if per_seed else "n/a")
    ratios = {arm: sum(ttft[(s, r, arm)] / ttft[(s, r, "ours:elora")] for s in (0, 1) for r in rates) / 4
              for arm in ABLATION_NAMES if (0, 1.0, arm) in ttft}
    assert len(ratios) == 12
    for arm, ratio in ratios.items():
        assert _table_cell(md, f"{ABLATION_NAMES[arm]} TTFT", 2) == f"{ratio:.2f}x", arm
    order_matters = any(abs(ratios[a] - 1) > NEGLIGIBLE for a in ORDER_ONLY)
    assert ("**The eviction order matters.**" in md) == order_matters
    assert ("**The eviction order barely matters here.**" in md) == (not order_matters)

    records = [json.loads(line) for line in open(f"{out}.jsonl")]
    assert records and {r["arm"] for r in records} == {"vllm", "slora", "sglang", "ours:elora"}
    assert all(r["extra"]["request_rate"] > 0 and 0 <= r["extra"]["hits"]["kv"] <= 1 for r in records)
    total = runs[0]["setup"]["pool_slots"] * runs[0]["setup"]["slot_bytes"]
    for arm in ("vllm", "ours:elora"):
        memory = [r["extra"]["memory_bytes"] for r in records if r["arm"] == arm and "memory_bytes" in r["extra"]]
        assert memory and all(sum(m.values()) == total for m in memory)


def test_run_any_workload_alora_pipeline():
    """eval.sim.run on the aLoRA pipeline workload: only ours serves the checks from the base answer's KV."""
    from eval.sim.run import run

    vllm, ours = run("alora_pipeline", ["vllm", "ours:elora"], {"num_pipelines": 6}, seed=2)
    checks = [r for r in ours.results if r.extra["kind"] == "alora"]
    assert checks and all(r.cached_tokens >= r.prompt_tokens - 5 for r in checks)
    assert all(r.cached_tokens == 0 for r in vllm.results if r.extra["kind"] == "alora")
    assert ours.summary["ttft_mean_s"] < vllm.summary["ttft_mean_s"]


@pytest.mark.parametrize("arm", ["ours:elora", "ours:elora:no-tree", "vllm"])
def test_alora_pipelines_under_pressure_keep_every_invariant(arm):
    """aLoRA suffixes hang below base KV and depend on their adapter: evicting under pressure must keep the
    accounting exact and (with the tree) never strand a suffix."""
    from eval.workloads import create_workload

    w = create_workload("alora_pipeline", seed=5, num_pipelines=25, pipeline_rate=2.0)
    run = simulate(arm, w.adapters, w.requests, alora_invocation_tokens=5,
                   config=SimConfig(check_every_step=True, pool_bytes=500_000_000))
    assert len(run.results) == len(w.requests)
    assert run.system.tree.stats().num_evicted_tokens > 0
    if arm == "ours:elora":
        assert _invalid_tokens_by_walk(run.system) == 0
        assert run.system.tree.stats().hits["alora_base_prefix"] > 0


# ---- host KV tier ------------------------------------------------------------------------------------------

def test_history_comes_back_from_host_hand_computed():
    """r1's KV is evicted by r2 (the pool holds 1100 tokens), so it goes to the host tier. r3 and r4 continue
    r1's conversation at t = 2: r3 gets r1's 1001 tokens copied back (one PCIe copy), r4 reuses them from the
    GPU but must wait for the same copy; both then prefill their 10 new tokens in one step. Without the tier r3
    recomputes all 1011 tokens."""
    reqs = [req("r1", 0.0, 1000, 1, session="a"), req("r2", 1.0, 1000, 1, session="b"),
            req("r3", 2.0, 10, 1, parent="r1", history=1001, session="a", turn=1),
            req("r4", 2.0, 10, 1, parent="r1", history=1001, session="c", turn=1)]
    cfg = SimConfig(check_every_step=True, pool_bytes=1100 * KVB)
    run = simulate("ours:elora", (), reqs, config=cfg)
    res = {r.rid: r for r in run.results}
    copy = 10e-6 + 1001 * KVB / 50e9  # h2d_time: PCIe latency + bytes / 50 GB/s
    pairs = 10 * 1001 + 10 * 11 / 2  # 10 new tokens after 1001 cached ones
    # both prefills in one step; 20 tokens are weight-read bound (16.06 GB at 85% of 3.35 TB/s)
    step = max(16.06e9 / HBM, 20 * 2 * 8.03e9 / FLOPS) + 4 * 32 * 4096 * (2 * pairs) / FLOPS
    assert step == pytest.approx(5.66e-3, rel=1e-2)
    for rid in ("r3", "r4"):
        assert res[rid].cached_tokens == 1001
        assert res[rid].ttft_s == pytest.approx(copy + step, rel=1e-12), rid
    assert res["r3"].extra["host_restored_tokens"] == 1001 and res["r4"].extra["host_restored_tokens"] == 0
    host = run.system.host
    assert host.counters.restored_tokens == 1001 and run.summary["num_kv_restores"] == 1
    assert host.used_bytes == 2002 * KVB  # r1 and r2 spilled; inclusive: r1's copy stays after the restore
    assert run.samples[-1]["host_kv"] == 2002 * KVB

    off = simulate("ours:elora:no-host-kv", (), reqs, config=cfg)
    r3 = next(r for r in off.results if r.rid == "r3")
    assert r3.cached_tokens == 0 and off.system.host is None and off.summary["num_kv_restores"] == 0
    alone = 1011 * 2 * 8.03e9 / FLOPS + 4 * 32 * 4096 * (1011 * 1012 / 2) / FLOPS
    assert r3.ttft_s == pytest.approx(alone, rel=1e-12)
    same = simulate("ours:elora", (), reqs, config=SimConfig(check_every_step=True, pool_bytes=1100 * KVB,
                                                              host_kv_bytes=0))
    assert [r.ttft_s for r in same.results] == [r.ttft_s for r in off.results]


def _host_tokens_by_walk(host) -> int:
    total, stack = 0, [host.tree.root]
    while stack:
        node = stack.pop()
        total += len(node.key) if node.kind is NodeKind.KV else 0
        stack.extend(node.children.values())
    return total


@pytest.mark.parametrize("arm", ["ours:elora", "ours:elora:no-tree", "ours:lru"])
def test_host_tier_accounting_exact_every_step(arm):
    """A 24-adapter workload in a 3 GB GPU pool and a 0.1 GB host pool: KV spills, the host drops its LRU runs and
    copies KV back; every step the GPU kinds and the host counter add up (the systems' checkers run each
    step), and KV only comes back below a resident adapter (invalid KV stays 0 with the tree)."""
    ads, reqs = chat(num_conversations=40, num_adapters=24, rank=(64,), modules=ALL, seed=1)
    cap = 100_000_000  # ~760 tokens: the host must drop runs
    run = simulate(arm, ads, reqs, config=SimConfig(pool_bytes=3_000_000_000, host_kv_bytes=cap,
                                                    check_every_step=True))
    host = run.system.host
    assert len(run.results) == len(reqs)
    assert host.counters.restored_tokens > 0 and host.counters.dropped_tokens > 0, "the test is too easy"
    assert host.used_bytes == _host_tokens_by_walk(host) * KVB
    assert host.used_bytes == (host.counters.spilled_tokens - host.counters.dropped_tokens) * KVB
    assert all(0 <= s["host_kv"] <= cap for s in run.samples)
    assert sum(r.extra["host_restored_tokens"] for r in run.results) == host.counters.restored_tokens
    assert not run.system.restores and run.system.restoring_tokens == 0
    if arm != "ours:elora:no-tree":
        assert all(s["invalid_kv"] == 0 for s in run.samples)
        assert _invalid_tokens_by_walk(run.system) == 0


@pytest.mark.parametrize("arm", ["vllm", "slora", "sglang", "ours:elora:no-host-kv"])
def test_baselines_have_no_host_tier(arm):
    ads, reqs = chat()
    run = simulate(arm, ads, reqs, config=SimConfig(check_every_step=True, pool_bytes=500_000_000))
    assert run.system.host is None and run.summary["num_kv_restores"] == 0
    assert all(s["host_kv"] == 0 for s in run.samples)
    assert all(r.extra["host_restored_tokens"] == 0 for r in run.results)

"""The simulator's admission policies: every request finishes under each, the multi-queue policy drives the real
`sgl_multilora.sched.MultiQueueScheduler` and lets a short request pass long high-rank ones, lpm orders by cached
prefix as SGLang does, and the Chameleon sweep writes its report from a tiny run."""

from __future__ import annotations

import json

import pytest

from eval.sim.admission import POLICIES, create_admission
from eval.sim.admission.lpm import LpmAdmission
from eval.sim.engine import SimConfig, _Loop, _sim_requests, simulate
from eval.sim.latency import Hardware, LatencyModel
from eval.sim.memory import pool_bytes
from eval.sim.systems import create_system
from eval.workloads.heterogeneous import HeterogeneousParams, generate
from eval.workloads.records import AdapterInfo, Request
from sgl_multilora.sched import multiqueue as mq_module
from sgl_multilora.sched.multiqueue import MultiQueueScheduler

LAT = LatencyModel()
ADAPTERS = (AdapterInfo("small", 8), AdapterInfo("big", 128))


def req(rid, t, new, out, adapter):
    return Request(rid, t, rid, 0, adapter, None, 0, new, out)


def hol_stream() -> list[Request]:
    """32 warm-up requests (26 short rank-8, 6 long rank-128: enough for the scheduler's first fit of queues), then
    at t = 30 s four long rank-128 requests and, right behind them, one short rank-8 request."""
    warm = [req(f"w{i}", 0.1 * i, 2000, 200, "big") if i % 5 == 0 else req(f"w{i}", 0.1 * i, 64, 8, "small")
            for i in range(32)]
    burst = [req(f"L{i}", 30.0 + 0.01 * i, 3000, 300, "big") for i in range(4)]
    return warm + burst + [req("S", 30.05, 50, 5, "small")]


def admit_order(run) -> list[str]:
    burst = [r for r in run.results if not r.rid.startswith("w")]
    return [r.rid for r in sorted(burst, key=lambda r: (r.arrival_s + r.extra["queue_s"], r.arrival_s))]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_request_finishes_with_invariants_checked(policy):
    w = generate(HeterogeneousParams(num_requests=60, num_adapters=10, rate=40.0, length_scale=0.1,
                                     max_output_tokens=128), seed=1)
    config = SimConfig(admission=policy, max_running=8, chunk_tokens=1024, check_every_step=True)
    run = simulate("ours:chameleon", w.adapters, w.requests, config=config)
    assert sorted(r.rid for r in run.results) == sorted(r.rid for r in w.requests)
    assert run.admission.name == policy
    assert max(r.extra["queue_s"] for r in run.results) > 0  # the small engine did make requests wait


@pytest.mark.parametrize("policy", ["fcfs", "multiqueue"])
def test_the_adapter_slot_cap_and_the_slot_squash_lose_nothing(policy, monkeypatch):
    """SGLang's per-batch adapter cap in the engine: every request finishes with its workload lengths, no batch
    holds more adapters than the cap, and under multiqueue the slot squash retracts decoding requests that later
    resume (their TTFT the first one's), with every invariant checked after each step."""
    w = generate(HeterogeneousParams(num_requests=80, num_adapters=10, rate=40.0, length_scale=0.1,
                                     max_output_tokens=128), seed=2)
    config = SimConfig(admission=policy, max_running=16, chunk_tokens=1024, check_every_step=True,
                       max_loras_per_batch=2, ttft_slo_s=0.5)
    widths = []
    real = _Loop._admit

    def admit(self, now):
        real(self, now)
        widths.append(len(self.running_by_adapter()))

    monkeypatch.setattr(_Loop, "_admit", admit)
    run = simulate("ours:chameleon", w.adapters, w.requests, config=config)
    by_rid = {r.rid: r for r in w.requests}
    assert sorted(r.rid for r in run.results) == sorted(by_rid)
    for r in run.results:
        want = by_rid[r.rid]
        assert (r.prompt_tokens, r.output_tokens) == (want.history_tokens + want.new_tokens, want.output_tokens)
        assert 0 < r.ttft_s <= r.e2e_s
    assert max(widths) == 2
    resumed = sum(1 for r in run.results if r.extra["resumed_tokens"])
    if policy == "multiqueue":
        counts = run.admission.mq.stats().counts
        assert counts["slot_squashes"] > 0 and counts["slot_squashed"] >= resumed > 0
    else:
        assert resumed == 0


def test_multiqueue_lets_a_short_request_pass_long_high_rank_ones(monkeypatch):
    calls = []
    real = MultiQueueScheduler.build_batch

    def counting(self, *args, **kwargs):
        calls.append(len(self.queues))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(mq_module.MultiQueueScheduler, "build_batch", counting)
    config = {"max_running": 2, "check_every_step": True}
    fcfs = simulate("ours:chameleon", ADAPTERS, hol_stream(), config=SimConfig(admission="fcfs", **config))
    assert not calls  # fcfs never asks the scheduler
    multi = simulate("ours:chameleon", ADAPTERS, hol_stream(), config=SimConfig(admission="multiqueue", **config))
    sched = multi.admission.mq
    assert type(sched) is MultiQueueScheduler and calls  # the real scheduler, called by the simulator
    assert sched.counts["finished"] == len(hol_stream()) and not sched.running and not len(sched.queues)
    assert sched.plan.num_queues >= 2 and sched.counts["refreshes"] >= 1
    assert admit_order(fcfs) == ["L0", "L1", "L2", "L3", "S"]
    assert admit_order(multi).index("S") < admit_order(multi).index("L2")  # S passed the waiting long ones
    ttft = {run.admission.name: {r.rid: r.ttft_s for r in run.results} for run in (fcfs, multi)}
    assert ttft["multiqueue"]["S"] < 0.5 * ttft["fcfs"]["S"]


def test_multiqueue_plans_with_the_memory_idle_adapters_hold_as_the_engine_admits_with_it():
    """On one pool the swapper fills idle memory with prefetched adapters; a request needing more than the free
    and evictable KV slots is admitted at once under fcfs (the engine evicts idle adapters for it), and must be
    under multiqueue too: its budget counts the reclaimable adapter slots (as SGLang's evictable_size does live),
    else the request never fits the budget."""
    lat = LatencyModel(hw=Hardware(hbm_total_bytes=27 * 10**9))  # ~58.7k slots: 30 rank-128 adapters fill 85%
    adapters = tuple(AdapterInfo(f"a{i}", 128) for i in range(30))
    stream = [req(f"w{i}", 0.1 * i, 200, 8, f"a{i}") for i in range(30)] + [req("big", 6.0, 30000, 8, "a0")]
    runs = {p: simulate("ours:chameleon", adapters, stream, lat=lat,
                        config=SimConfig(admission=p, check_every_step=True)) for p in ("fcfs", "multiqueue")}
    big = {p: next(r for r in run.results if r.rid == "big") for p, run in runs.items()}
    assert all(run.system.swapper.counters.adapter_evictions > 0 for run in runs.values())  # it needed their room
    assert big["fcfs"].extra["queue_s"] == big["multiqueue"].extra["queue_s"] == 0.0
    assert big["multiqueue"].ttft_s == pytest.approx(big["fcfs"].ttft_s)


def test_lpm_puts_cached_prefixes_first_and_defers_in_batch_duplicates():
    shared = tuple(range(100, 164))  # 64 tokens two waiting requests share, not cached
    cached = tuple(range(500, 600))
    system = create_system("ours:chameleon:no-host-kv", ADAPTERS, LAT, pool_bytes(LAT))
    reqs = _sim_requests(ADAPTERS, (req("a", 0, 80, 4, None), req("b", 0, 80, 4, None),
                                    req("c", 0, 80, 4, None), req("d", 0, 120, 4, None)), 5)
    a, b, c, d = reqs
    a.prompt, b.prompt, c.prompt = shared + (1,) * 16, shared + (2,) * 16, (3,) * 80
    d.prompt = cached + (4,) * 20
    system.tree.insert(system.key(d, cached), [-1] * len(cached))
    lpm = create_admission("lpm", system, LAT, SimConfig(), reqs)
    assert isinstance(lpm, LpmAdmission) and lpm.matched_len(d) == 100 and lpm.matched_len(a) == 0
    waiting = [a, b, c, d]
    assert lpm.candidates(waiting, 0.0, 0) == [d, a, c, b]  # d matched 100; b shares 64 tokens with a: last
    assert waiting == [d, a, c, b]  # sorted in place, as SGLang sorts its waiting queue


def test_unknown_policy_is_named():
    with pytest.raises(ValueError, match="fcfs, lpm, multiqueue"):
        simulate("ours:chameleon", ADAPTERS, hol_stream()[:2], config=SimConfig(admission="sjf"))


def test_sweep_writes_records_and_report(tmp_path):
    from eval.sim import sched_compare

    out = tmp_path / "sim_chameleon"
    sched_compare.main(["--rates", "4,30", "--seeds", "0,1", "--window-s", "4", "--light-rate", "2",
                        "--out", str(out)])
    records = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    sweep = [r for r in records if r["kind"] == "sweep"]
    assert len(sweep) == 2 * 2 * len(POLICIES) and len(records) == len(sweep) + 2
    assert all(r["sched"] is not None for r in sweep if r["setup"]["policy"] == "multiqueue")
    light_e2e = [x["summary"]["e2e_mean_s"] for x in records if x["kind"] == "light"]
    assert all(r["setup"]["ttft_slo_s"] == pytest.approx(5 * sum(light_e2e) / 2) for r in sweep)  # 5 x median
    md = out.with_suffix(".md").read_text()
    assert "## Headline" in md and "| 30 | multiqueue |" in md and "simulated" in md
    assert "distinct adapters per batch" not in md and "Slot squashes" not in md


def test_sweep_with_the_adapter_slot_cap_reports_it(tmp_path):
    from eval.sim import sched_compare

    out = tmp_path / "sim_chameleon_cap"
    sched_compare.main(["--rates", "30", "--seeds", "0", "--window-s", "4", "--light-rate", "2",
                        "--max-loras-per-batch", "2", "--max-slot-squashes", "3", "--out", str(out)])
    records = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    assert all(r["setup"]["sim_config"]["max_loras_per_batch"] == 2 for r in records)
    assert all(r["setup"]["sim_config"]["max_slot_squashes"] == 3 for r in records)
    mq = [r for r in records if r["setup"]["policy"] == "multiqueue"]
    assert mq and all("slot_squashes" in r["sched"]["counts"] for r in mq)
    md = out.with_suffix(".md").read_text()
    assert "at most 2 distinct adapters per batch" in md and "slot squash after 0.5 of the SLO, at most 3 per" in md


def test_a_subset_of_policies_writes_the_records_and_no_report(tmp_path, capsys):
    from eval.sim import sched_compare

    out = tmp_path / "probe"
    sched_compare.main(["--rates", "30", "--seeds", "0", "--window-s", "4", "--light-rate", "2",
                        "--policies", "fcfs,multiqueue", "--out", str(out)])
    records = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    assert {r["setup"]["policy"] for r in records if r["kind"] == "sweep"} == {"fcfs", "multiqueue"}
    assert not out.with_suffix(".md").exists() and "run without --policies" in capsys.readouterr().out
    for bad in (["--policies", "multiqueue,fcfs"], ["--policies", "fcfs,fifo"], ["--max-slot-squashes", "-1"]):
        with pytest.raises(SystemExit):  # refused before any simulation runs
            sched_compare.main([*bad, "--out", str(out)])

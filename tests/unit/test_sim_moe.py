"""The MoE-scale simulator terms (eval/sim/moe_latency.py, link.ServerLoader) against hand arithmetic, and the
invariants of the compared arms (eval/sim/systems/moe.py, eval/sim/moe_compare.py)."""

from __future__ import annotations

import pytest

from eval.sim import moe_compare as mc
from eval.sim.latency import H100_SXM, H200_SXM
from eval.sim.link import IB_400G, ServerLoader
from eval.sim.moe_latency import MIXTRAL_8X7B, QWEN3_30B_A3B, MoeLatencyModel, ServerLoad
from eval.sim.systems.moe import CoupledSplit, InfiniInstance

HBM = 3.35e12 * 0.85  # H100, at the model's efficiency
F = 989.5e12 * 0.6


def test_adapter_sizes_match_hand_arithmetic():
    # layers x experts x 3 x r x (h + I) x 2 B
    assert MIXTRAL_8X7B.adapter_bytes(64) == 32 * 8 * 3 * 64 * (4096 + 14336) * 2 == 1_811_939_328
    assert QWEN3_30B_A3B.adapter_bytes(16) == 48 * 128 * 3 * 16 * (2048 + 768) * 2 == 1_660_944_384
    assert MIXTRAL_8X7B.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert QWEN3_30B_A3B.kv_bytes_per_token == 2 * 48 * 4 * 128 * 2
    with pytest.raises(ValueError):
        MIXTRAL_8X7B.adapter_bytes(64, ("q_proj",))


def test_distinct_experts():
    lat = MoeLatencyModel(model=MIXTRAL_8X7B)
    assert lat.distinct_experts(0) == 0
    assert lat.distinct_experts(1) == pytest.approx(2)  # one token reaches its top-2
    assert lat.distinct_experts(2) == pytest.approx(8 * (1 - 0.75 ** 2))
    assert lat.distinct_experts(10_000) == pytest.approx(8)


def test_base_step_by_hand():
    lat = MoeLatencyModel(model=MIXTRAL_8X7B, hw=H100_SXM, gpus=2, lora_mode="none")
    m = MIXTRAL_8X7B
    b, ctx = 64, 100_000
    expert = 3 * 4096 * 14336
    dense_params = 46.7e9 - 32 * 8 * expert
    dense = max(dense_params * 2 / (2 * HBM), 2 * dense_params * b / (2 * F))
    d = 8 * (1 - 0.75 ** b)
    experts = max(d * expert * 2 / (2 * HBM), 2 * b * 2 * expert / (2 * F))
    a2a = 2 * b * 2 * 4096 * 2 * 0.5 / 450e9
    attention = ctx * m.kv_bytes_per_token / (2 * HBM)
    want = dense + 32 * (experts + a2a) + attention
    # decode only: 60 decoding + 4 joining (their prompts' KV is read once: 1,000 tokens)
    assert lat.step_time(1_000, 0.0, 60, ctx - 1_000, (), prefill_requests=4) == pytest.approx(want)
    assert lat.step_time(0, 0.0, 0, 0) == 0.0


def test_local_lora_by_hand():
    lat = MoeLatencyModel(model=MIXTRAL_8X7B, gpus=2, lora_mode="local")
    base = lat.step_time(0, 0.0, 3, 0)
    lora = [(3, 64, None, 0)]  # one adapter, 3 tokens
    d = 8 * (1 - 0.75 ** 3)
    rows = 3 * 2
    gu = 2 * 4e-6 + (d * 2 * 64 * (4096 + 14336) * 2 + rows * (4096 + 4 * 14336) * 2) / (2 * HBM)
    dn = 2 * 4e-6 + (d * 64 * (4096 + 14336) * 2 + rows * (14336 + 2 * 4096) * 2) / (2 * HBM)
    assert lat.lora_call_s(lora, "gate_up", 2) == pytest.approx(gu)
    assert lat.step_time(0, 0.0, 3, 0, lora) == pytest.approx(base + 32 * (gu + dn))


def test_remote_round_trip_overlap_and_pipeline():
    kw = dict(model=MIXTRAL_8X7B, gpus=2, lora_mode="remote", server_x=4, server_y=2)
    lat = MoeLatencyModel(**kw)
    lora = [(128, 64, None, 0)]
    recv, comp, send = lat.remote_stages(lora, "gate_up")
    rows = 256
    assert recv == pytest.approx(IB_400G.latency_s + rows * 4096 * 2 / (2 * 50e9))  # min(2 GPUs, x=4) NICs
    assert send == pytest.approx(IB_400G.latency_s + rows * 2 * 14336 * 2 / (2 * 50e9))
    assert comp == pytest.approx(lat.lora_call_s(lora, "gate_up", 4))
    dr, dc, ds = lat.remote_stages(lora, "down")
    base, exp = lat.base_step_s(128, 0), lat.expert_layer_s(128)
    overlapped = base + 32 * (max(exp * 2 / 3, recv + comp + send) + max(exp / 3, dr + dc + ds) - exp)
    assert lat.step_time(0, 0.0, 128, 0, lora) == pytest.approx(overlapped)
    serial = MoeLatencyModel(**kw, overlap=False).step_time(0, 0.0, 128, 0, lora)
    assert serial == pytest.approx(base + 32 * (recv + comp + send + dr + dc + ds))
    assert serial > overlapped
    # the server pipeline: with three other instances in a step, each step needs (32 / y) x 4 stages
    load = ServerLoad(groups=2, clock=lambda: 1.0)
    stage = max(recv, comp, send) + max(dr, dc, ds)
    load.busy = {1: (stage, 2.0), 2: (stage, 2.0), 3: (stage, 2.0), 4: (stage, 0.5)}  # 4 has ended
    shared = MoeLatencyModel(**kw, server=load, instance=0).step_time(0, 0.0, 128, 0, lora)
    assert shared == pytest.approx(max(overlapped, 32 / 2 * 4 * stage))
    assert load.busy[0] == (pytest.approx(stage), pytest.approx(1.0 + shared))


def test_server_loader_layerwise():
    lat = MoeLatencyModel(model=MIXTRAL_8X7B)
    size = MIXTRAL_8X7B.adapter_bytes(64)
    now = [0.0]
    for layerwise in (True, False):
        ld = ServerLoader(lat, {"a": size, "b": size}, lambda: now[0], gpus=4, num_layers=32, layerwise=layerwise)
        ld.start("a", None)
        ld.start("b", None)
        whole = 10e-6 + size / (4 * 50e9)
        first = 10e-6 + (size // 32) / (4 * 50e9)
        assert ld.done_s("a") == pytest.approx(first if layerwise else whole)
        assert ld.done_s("b") == pytest.approx(whole + (first if layerwise else whole))  # FIFO behind a
    assert H200_SXM.hbm_total_bytes > H100_SXM.hbm_total_bytes


@pytest.fixture(scope="module")
def small_setup():
    return mc.make_setup(MIXTRAL_8X7B, "h100", 24)


@pytest.mark.parametrize("arm", ["slora", "slora-less", "infinilora", "infinilora:+disagg"])
def test_arms_invariants(small_setup, arm):
    s = small_setup
    reqs = mc.make_requests(s.adapters, s.p, 30.0, 4.0, seed=1)
    runs = mc.run_arm(s, arm, reqs, check=True)
    assert sum(len(r.results) for r in runs) == len(reqs)
    for run in runs:
        system = run.system
        lat = system.lat
        slots = mc.instance_pool_bytes(lat) // MIXTRAL_8X7B.kv_bytes_per_token
        if arm.startswith("infinilora"):
            assert isinstance(system, InfiniInstance)
            assert len(runs) == s.instances
            assert system.adapter_bytes_held() == 0 and system.kv_pool.num_slots == slots  # all KV
            assert system.server.residency.num_resident <= s.server_capacity
        else:
            assert isinstance(system, CoupledSplit) and len(runs) == 8
            frac = 0.5 if arm == "slora" else 0.4
            assert system.adapter_pool.num_slots == int(slots * frac)
            assert system.kv_pool.num_slots == slots - int(slots * frac)
    assert s.server_capacity >= s.plan.cache.min_cached_adapters
    assert s.instances * 2 + s.server_gpus <= 16 and s.server_gpus >= s.plan.server_gpus

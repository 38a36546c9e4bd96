"""The LoRA-server planner (InfiniLoRA §4.2) against independent computations: P_free against enumerating every
residency set, IAR and M* against Alg 1 as the paper lists it (a full Poisson-binomial DP per adapter, every M in
order), the Poisson tail against the pmf summed term by term, the reference's reproduction of the paper's
Qwen3-30B-A3B check, then the GPU counts (Eq 5-6), the fixed point with the instances, the command line."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from sgl_multilora import plan as plan_cli
from sgl_multilora import planner


def poisson_tail_terms(lam: float, tau: int) -> float:
    return 1.0 - sum(math.exp(k * math.log(lam) - lam - math.lgamma(k + 1)) for k in range(tau + 1))


def alg1_listing(p: np.ndarray, lb: float, m: int) -> float:
    """IAR(m) exactly as Alg 1 lists it: an untruncated DP over j != i for every i (O(N^2) per i)."""
    lam = lb * p
    tau = planner.tau_for(lam, m)
    q = [poisson_tail_terms(x, tau) for x in lam]
    n, total = len(p), 0.0
    for i in range(n):
        dp = [1.0] + [0.0] * n
        for j in range(n):
            if j == i:
                continue
            for k in range(n, 0, -1):
                dp[k] = dp[k] * (1 - q[j]) + dp[k - 1] * q[j]
            dp[0] *= 1 - q[j]
        total += p[i] * (q[i] + (1 - q[i]) * sum(dp[:m]))
    return total


@pytest.mark.parametrize("lam,tau", [(0.01, 0), (0.5, 0), (3.0, 2), (20.0, 15), (200.0, 180)])
def test_poisson_tail(lam, tau):
    assert planner.poisson_tail(np.array([lam]), tau)[0] == pytest.approx(poisson_tail_terms(lam, tau), abs=1e-12)


def test_p_free_equals_enumerating_every_residency_set():
    rng = np.random.default_rng(3)
    q = rng.uniform(0, 1, size=7)
    for m in (1, 2, 4, 6):
        want = []
        for i in range(7):
            others = [j for j in range(7) if j != i]
            mass = 0.0
            for bits in itertools.product((0, 1), repeat=6):
                if sum(bits) <= m - 1:
                    mass += math.prod(q[j] if b else 1 - q[j] for j, b in zip(others, bits))
            want.append(mass)
        assert planner.p_free(q, m) == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("s,lb", [(1.2, 40), (0.8, 10), (1.5, 200)])
def test_iar_and_min_cache_equal_alg1_as_listed(s, lb):
    p = planner.zipf_popularity(24, s)
    for m in (1, 3, 8, 15, 23):
        assert planner.iar(p, lb, m)[0] == pytest.approx(alg1_listing(p, lb, m), abs=1e-10)
    for alpha in (0.5, 0.8, 0.95, 0.99):
        want = next(m for m in range(1, 25) if (alg1_listing(p, lb, m) if m < 24 else 1.0) >= alpha)
        assert planner.min_cached_adapters(p, lb, alpha).min_cached_adapters == want


def test_the_papers_check_under_the_integer_tau():
    """Qwen3-30B-A3B, 4 instances (the paper: IAR 83.0 / 92.2 / 100.0% at M = 128 / 192 / 256 on its own popularity
    data, which are not public). Assumed here: 512 adapters of Zipf(1.2) popularity and LB = 4 x 256; the integer tau
    gives 89.3 / 92.4 / 100.0% (reference/seed-infinilora.md, 3.1)."""
    p = planner.zipf_popularity(512, 1.2)
    got = [round(100 * planner.iar(p, 1024, m)[0], 1) for m in (128, 192, 256)]
    assert got == [89.3, 92.4, 100.0]


def test_provision_memory_tpot_and_the_fixed_point(tmp_path):
    p = planner.zipf_popularity(512, 1.2)
    base = dict(batch=256, instances=4, alpha=0.95, adapter_gb=1.69, gpu_gb=96)
    plan = planner.provision(p, **base)
    assert (plan.cache.min_cached_adapters, plan.gpus_for_memory, plan.server_gpus) == (198, 4, 4)
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({"2": {"recv_s": 1e-3, "compute_s": 2e-3, "send_s": 1e-3},
                                "4": {"recv_s": 4e-4, "compute_s": 6e-4, "send_s": 4e-4},
                                "8": {"recv_s": 2e-4, "compute_s": 2e-4, "send_s": 2e-4}}))
    profile = planner.load_profile(prof)
    # SLO_Layer = 0.1 / 48 = 2.08 ms, SLO_FFN = 1.04 ms: 2 GPUs fail Eq 5 (4 ms), 4 GPUs give 1.4 ms > 1.04: 8 GPUs
    tp = planner.provision(p, **base, profile=profile, tpot_slo_s=0.1, num_layers=48)
    assert (tp.gpus_for_tpot, tp.server_gpus) == (8, 8) and tp.slo_ffn_s == pytest.approx(0.1 / 48 / 2)
    # 16 GPUs in all: a server of 8 leaves 8 one-GPU instances; LB doubles, M* grows; iterated until it repeats
    fixed = planner.provision(p, **base, profile=profile, tpot_slo_s=0.1, num_layers=48, total_gpus=16)
    assert fixed.server_gpus + fixed.instances <= 16 and fixed.iterations >= 2
    assert fixed.cache.global_batch == fixed.instances * 256
    with pytest.raises(ValueError, match="no profiled server size meets"):
        planner.provision(p, **base, profile=profile, tpot_slo_s=0.001, num_layers=48)
    with pytest.raises(ValueError, match="does not fit one GPU"):
        planner.provision(p, **{**base, "adapter_gb": 100})


def test_trace_popularity(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join(json.dumps({"adapter": a}) for a in ["x", "y", "x", None, "x", "z"]) + "\n")
    p, names = planner.trace_popularity(f)
    assert names == ["x", "y", "z"] and p.tolist() == pytest.approx([0.6, 0.2, 0.2])
    c = tmp_path / "t.csv"
    c.write_text("id,adapter\n1,a\n2,b\n3,a\n")
    assert planner.trace_popularity(c)[1] == ["a", "b"]
    (tmp_path / "bad.csv").write_text("id,model\n1,a\n")
    with pytest.raises(ValueError, match="no 'adapter' column"):
        planner.trace_popularity(tmp_path / "bad.csv")


def test_the_command_line(capsys, tmp_path):
    assert plan_cli.main(["--popularity", "zipf:1.2", "--adapters", "512", "--batch", "256", "--instances", "4",
                          "--adapter-gb", "1.69", "--gpu-gb", "96", "--json", "--plot", str(tmp_path / "iar.png")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["min_cached_adapters"] == 198 and out["server_gpus"] == 4 and "integer tau" in out["tau_convention"]
    assert (tmp_path / "iar.png").stat().st_size > 1000
    with pytest.raises(SystemExit):
        plan_cli.main(["--popularity", "uniform", "--adapters", "4", "--batch", "1", "--instances", "1",
                       "--adapter-gb", "1", "--gpu-gb", "2"])
    assert "expected zipf:S" in capsys.readouterr().err
    assert plan_cli.main(["--popularity", "zipf:1", "--adapters", "8", "--batch", "1", "--instances", "1",
                          "--adapter-gb", "3", "--gpu-gb", "2"]) == 2
    assert "does not fit one GPU" in capsys.readouterr().err

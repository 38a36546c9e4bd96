"""Workload generators: deterministic for a seed, and their statistics match their parameters.

Oracles are written here independently of the generators: the Zipf law 1/i^s, a chi-square bound, the Azure CSV read
with the csv module, the embedded model's real tokenizer for prompt text lengths.
"""

from __future__ import annotations

import csv
import datetime
from collections import Counter

import numpy as np
import pytest

from eval.workloads import WORKLOADS, create_workload
from eval.workloads.base import AZURE_CONV_CSV
from eval.workloads.text import fresh_text, words

# chi-square critical values at p = 0.001 by degrees of freedom (standard tables)
CHI2_999 = {4: 18.47, 9: 27.88, 19: 43.82}


def chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs))


def zipf(n: int, s: float) -> list[float]:
    w = [1 / i**s for i in range(1, n + 1)]
    return [x / sum(w) for x in w]


def csv_rows():
    with open(AZURE_CONV_CSV, newline="") as f:
        rows = list(csv.DictReader(f))
    t0 = datetime.datetime.fromisoformat(rows[0]["TIMESTAMP"][:26])
    return [
        (
            (datetime.datetime.fromisoformat(r["TIMESTAMP"][:26]) - t0).total_seconds(),
            int(r["ContextTokens"]),
            int(r["GeneratedTokens"]),
        )
        for r in rows
    ]


SMALL = {
    "chatbot": {"num_conversations": 30},
    "translation": {"num_requests": 100},
    "agent": {"num_sessions": 10},
    "alora_pipeline": {"num_pipelines": 20},
    "heterogeneous": {"num_requests": 100},
}


@pytest.mark.parametrize("name", list(SMALL))
def test_generators_are_deterministic_for_a_seed(name):
    a = create_workload(name, seed=3, **SMALL[name])
    b = create_workload(name, seed=3, **SMALL[name])
    c = create_workload(name, seed=4, **SMALL[name])
    assert a.requests == b.requests and a.adapters == b.adapters
    assert [r.tags for r in a.requests] == [r.tags for r in b.requests]
    assert a.requests != c.requests


def test_unknown_workload_and_parameter_are_named():
    with pytest.raises(ValueError, match="unknown workload 'chat'.*chatbot"):
        create_workload("chat")
    with pytest.raises(ValueError, match="unknown parameter 'num_users'.*num_conversations"):
        create_workload("chatbot", num_users=3)
    with pytest.raises(ValueError, match="zipf_s='x': expected float"):
        create_workload("chatbot", zipf_s="x")
    assert set(WORKLOADS) == {
        "chatbot",
        "translation",
        "agent",
        "alora_pipeline",
        "heterogeneous",
        "trace",
    }


def test_chatbot_statistics_match_parameters():
    w = create_workload(
        "chatbot",
        seed=0,
        num_conversations=4000,
        num_adapters=10,
        zipf_s=1.2,
        conversation_rate=2.0,
        mean_turns=3.0,
        think_time_s=5.0,
        mean_new_tokens=50.0,
        mean_output_tokens=80.0,
        system_tokens=32,
    )
    first = [r for r in w.requests if r.turn == 0]
    assert len(first) == 4000
    # adapter popularity per conversation follows Zipf(1.2) over adapters in name order
    names = sorted(a.name for a in w.adapters)
    counts = Counter(r.adapter for r in first)
    assert chi_square([counts[n] for n in names], zipf(10, 1.2)) < CHI2_999[9]
    # conversations arrive as a Poisson process of rate 2/s: mean gap 0.5 s, coefficient of variation 1
    gaps = np.diff(sorted(r.arrival_s for r in first))
    assert gaps.mean() == pytest.approx(0.5, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.06)
    turns = Counter(r.session for r in w.requests)
    assert np.mean(list(turns.values())) == pytest.approx(3.0, rel=0.05)
    assert np.mean([r.output_tokens for r in w.requests]) == pytest.approx(80.0, rel=0.05)
    later = [r for r in w.requests if r.turn > 0]
    assert np.mean([r.new_tokens for r in later]) == pytest.approx(50.0, rel=0.05)
    assert all(r.new_tokens >= 33 and r.shared_prefix == "system" for r in first)
    by_rid = {r.rid: r for r in w.requests}
    for r in later:  # each turn extends the previous one of its conversation, after it
        parent = by_rid[r.parent_rid]
        assert (
            parent.session == r.session
            and parent.turn == r.turn - 1
            and parent.arrival_s < r.arrival_s
        )
        assert (
            r.history_tokens == parent.prompt_tokens + parent.output_tokens
            and r.adapter == parent.adapter
        )


def test_translation_keeps_the_azure_trace_and_shifts_popularity():
    rows = csv_rows()[100:1100]
    w = create_workload(
        "translation",
        seed=1,
        num_requests=1000,
        first_row=100,
        num_adapters=10,
        zipf_s=1.2,
        shift_period_s=100.0,
        length_scale=0.5,
        max_prompt_tokens=100000,
        time_scale=2.0,
    )
    t0 = rows[0][0]
    assert [r.arrival_s for r in w.requests] == pytest.approx([(t - t0) / 2.0 for t, _, _ in rows])
    assert [r.new_tokens for r in w.requests] == [max(1, round(c * 0.5)) for _, c, _ in rows]
    assert [r.output_tokens for r in w.requests] == [max(1, round(g * 0.5)) for _, _, g in rows]
    windows: dict[int, Counter] = {}
    for r, (t, _, _) in zip(w.requests, rows):
        windows.setdefault(int((t - t0) // 100.0), Counter())[r.adapter] += 1
    tops = [c.most_common(1)[0][0] for _, c in sorted(windows.items())]
    assert len(set(tops)) > 1, "the most popular adapter shifts between windows"
    for k, counter in sorted(
        windows.items()
    ):  # within a window popularity is Zipf over that window's ranking
        order = w.notes["popular_adapter_by_window"][k]
        if sum(counter.values()) > 150:
            assert counter.most_common(1)[0][0] == order
            ranked = sorted(counter.values(), reverse=True)
            assert ranked[0] / sum(counter.values()) == pytest.approx(zipf(10, 1.2)[0], abs=0.1)


def test_agent_sessions_are_long_and_share_their_scene_prefix():
    w = create_workload(
        "agent",
        seed=2,
        num_sessions=300,
        min_turns=8,
        max_turns=12,
        scene_tokens=100,
        mean_new_tokens=20.0,
        mean_output_tokens=30.0,
        session_rate=1.0,
    )
    turns = Counter(r.session for r in w.requests)
    assert min(turns.values()) == 8 and max(turns.values()) == 12
    assert np.mean(list(turns.values())) == pytest.approx(10.0, rel=0.05)
    for r in w.requests:
        assert r.shared_prefix == f"scene:{r.adapter}" and r.shared_prefix_tokens == 100
    last = [r for r in w.requests if r.turn == turns[r.session] - 1]
    assert (
        np.mean([r.prompt_tokens for r in last]) > 400
    )  # history grows: 100 + ~10 turns of 50 tokens
    assert np.mean([r.new_tokens for r in w.requests if r.turn > 0]) == pytest.approx(
        20.0, rel=0.08
    )


def test_alora_pipeline_structure():
    w = create_workload(
        "alora_pipeline",
        seed=0,
        num_pipelines=50,
        num_aloras=2,
        checks_per_pipeline=3,
        invocation_tokens=5,
        check_output_tokens=2,
        pipeline_rate=0.5,
    )
    by_session: dict[str, list] = {}
    for r in w.requests:
        by_session.setdefault(r.session, []).append(r)
    assert len(by_session) == 50
    for reqs in by_session.values():
        base = next(r for r in reqs if r.turn == 0)
        checks = [r for r in reqs if r.adapter is not None]
        cont = [r for r in reqs if r.adapter is None and r.turn > 0]
        assert (
            base.adapter is None and base.parent_rid is None and len(checks) == 3 and len(cont) == 1
        )
        assert [c.adapter for c in sorted(checks, key=lambda c: c.turn)] == [
            "alora-000",
            "alora-001",
            "alora-000",
        ]
        for c in checks:
            assert (
                c.alora_invocation
                and c.parent_rid == base.rid
                and c.new_tokens == 5
                and c.output_tokens == 2
            )
            assert c.history_tokens == base.prompt_tokens + base.output_tokens
        assert (
            cont[0].parent_rid == base.rid
            and cont[0].arrival_s > max(c.arrival_s for c in checks) - 1e-9
        )
    assert all(a.kind == "alora" for a in w.adapters)


def test_heterogeneous_matches_chameleons_mix():
    w = create_workload(
        "heterogeneous",
        seed=5,
        num_requests=5000,
        num_adapters=50,
        zipf_s=1.0,
        rate=8.0,
        length_scale=0.5,
        max_prompt_tokens=100000,
        max_output_tokens=100000,
    )
    rank_of = {a.name: a.rank for a in w.adapters}
    assert Counter(rank_of.values()) == {8: 10, 16: 10, 32: 10, 64: 10, 128: 10}
    ranks = Counter(rank_of[r.adapter] for r in w.requests)  # uniform rank popularity
    assert chi_square([ranks[k] for k in (8, 16, 32, 64, 128)], [0.2] * 5) < CHI2_999[4]
    within = Counter(
        r.adapter for r in w.requests if rank_of[r.adapter] == 32
    )  # power law within a rank
    names = sorted(a.name for a in w.adapters if a.rank == 32)
    assert chi_square([within[n] for n in names], zipf(10, 1.0)) < CHI2_999[9]
    gaps = np.diff([r.arrival_s for r in w.requests])
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.05)
    trace_pairs = {(max(1, round(c * 0.5)), max(1, round(g * 0.5))) for _, c, g in csv_rows()}
    assert all((r.new_tokens, r.output_tokens) in trace_pairs for r in w.requests)
    sizes = Counter(r.tags["size"] for r in w.requests)
    assert sizes["short"] > 0 and sizes["long"] > 0


def test_prompt_text_has_the_planned_token_count(tokenizer):
    for num in (1, 37, 300):
        assert len(tokenizer(words(f"k{num}", num), add_special_tokens=False).input_ids) == num
    w = create_workload("chatbot", seed=0, num_conversations=5, system_tokens=20)
    first = [r for r in w.requests if r.turn == 0]
    texts = [fresh_text(r) for r in first]
    assert all(
        len(tokenizer(t, add_special_tokens=False).input_ids) == r.new_tokens
        for t, r in zip(texts, first)
    )
    assert (
        len({t[: len(words("prefix:system", 20))] for t in texts}) == 1
    )  # the shared system prompt
    assert fresh_text(first[0]) == texts[0]


def test_capped_trace_lengths_are_counted_and_warned():
    rows = csv_rows()[:200]
    expected = sum(1 for _, c, g in rows if round(c * 0.5) > 300 or round(g * 0.5) > 2048)
    assert expected > 0
    with pytest.warns(UserWarning, match=f"translation: {expected} of 200 trace lengths capped"):
        w = create_workload(
            "translation", num_requests=200, length_scale=0.5, max_prompt_tokens=300
        )
    assert w.notes["num_capped"] == expected
    assert max(r.new_tokens for r in w.requests) == 300

"""Reports from results JSON lines: figures checked against values worked out by hand here."""

from __future__ import annotations

import json
import statistics

import pytest

from eval.live.report import load_results, peak_load, ratios, summarize, write_report
from eval.workloads.records import RequestResult

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def record(arm, rate, ttft, i, **extra) -> dict:
    r = RequestResult(
        "chatbot",
        arm,
        f"r{i}",
        "caps",
        float(i),
        100,
        10,
        cached_tokens=40 if arm == "ours" else 0,
        ttft_s=ttft,
        tpot_s=ttft / 10,
        e2e_s=ttft * 2,
        extra={"request_rate": rate, "kind": "lora", **extra},
    )
    return r.to_json()


def results(tmp_path):
    recs = []
    for rate, (ours, stock) in {1.0: (0.1, 0.2), 2.0: (0.3, 0.6), 4.0: (0.9, 1.8)}.items():
        for i in range(10):
            recs.append(record("ours", rate, ours + 0.01 * i, i))
            recs.append(record("stock", rate, stock + 0.02 * i, i))
    recs.append({**record("stock", 4.0, 1.0, 99), "ttft_s": None, "error": "HTTP 500"})
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_summary_figures_match_hand_computed_values(tmp_path):
    rows = summarize(load_results([results(tmp_path)]))
    assert [(r.arm, r.rate, r.num, r.num_errors) for r in rows] == [
        ("ours", 1.0, 10, 0),
        ("ours", 2.0, 10, 0),
        ("ours", 4.0, 10, 0),
        ("stock", 1.0, 10, 0),
        ("stock", 2.0, 10, 0),
        ("stock", 4.0, 11, 1),
    ]
    ours1 = rows[0]
    ttfts = [0.1 + 0.01 * i for i in range(10)]
    assert ours1.ttft_mean == pytest.approx(statistics.mean(ttfts))
    assert ours1.ttft_p50 == pytest.approx(statistics.median(ttfts))
    assert ours1.ttft_p99 == pytest.approx(
        0.1 + 0.01 * (9 * 0.99)
    )  # linear interpolation between 8 and 9
    assert ours1.tpot_mean == pytest.approx(statistics.mean(ttfts) / 10)
    assert ours1.prefix_hit_by_kind == {"lora": pytest.approx(0.4)}
    assert rows[3].prefix_hit_by_kind == {"lora": 0.0}
    # mean TTFT: ours 0.145 / 0.345 / 0.945, stock 0.29 / 0.69 / 1.89 -> under a 0.5 s SLO ours holds 2 req/s
    assert peak_load(rows, 0.5) == {("chatbot", "ours"): 2.0, ("chatbot", "stock"): 1.0}
    table = {(t["rate"], t["arm"]): t for t in ratios(rows, ["stock"])}
    assert set(table) == {(1.0, "ours"), (2.0, "ours"), (4.0, "ours")}
    assert table[(2.0, "ours")]["ttft_mean"] == pytest.approx(0.345 / 0.69)


def test_report_writes_markdown_and_pngs(tmp_path):
    recs = load_results([results(tmp_path)])
    for i, t in enumerate(
        (0.0, 1.0, 2.0)
    ):  # a simulated arm that carries hits, invalid KV and memory
        recs.append(
            {
                **record(
                    "sim:elora",
                    1.0,
                    0.2,
                    50 + i,
                    hits={"kv": 0.5, "lora": 1.0},
                    invalid_kv_share=0.0,
                    memory_bytes={"lora": 2**30 * (i + 1), "kv": 2**31},
                    memory_t_s=t,
                )
            }
        )
    md, pngs = write_report(recs, tmp_path / "out", ["stock"], slo_s=0.5)
    text = md.read_text()
    assert "| chatbot | ours | 1 | 10 | 0 | 145 / 145 / 189 |" in text
    assert "| chatbot | stock | 4 | 11 | 1 |" in text
    assert "| chatbot | ours | 2 |" in text.split("Peak load")[1]
    assert "kv 50%, lora 100%" in text and "kv 2048, lora 3072" in text
    assert "| chatbot | 2 | ours | stock | 0.50x |" in text
    names = sorted(p.name for p in pngs)
    assert names == ["memory_chatbot_sim_elora.png", "ttft_vs_rate_chatbot.png"]
    for p in pngs:
        assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 5000


def test_bad_results_line_is_named(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(record("ours", 1.0, 0.1, 0)) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"r.jsonl:2: not a RequestResult record"):
        load_results([path])

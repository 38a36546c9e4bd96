"""Reports from results JSON lines: figures checked against values worked out by hand here."""

from __future__ import annotations

import json
import statistics

import pytest

from eval.live.report import (
    Spread,
    load_results,
    memory_series,
    peak_load,
    ratios,
    summarize,
    write_report,
)
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
    summaries = summarize(load_results([results(tmp_path)]))
    assert [s.num_repeats for s in summaries] == [1] * 6, "records without a repeat field: one repeat"
    rows = [s.rows[0] for s in summaries]
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
    assert peak_load(summaries, 0.5) == {("chatbot", "ours"): 2.0, ("chatbot", "stock"): 1.0}
    table = {(t["rate"], t["arm"]): t for t in ratios(summaries, ["stock"])}
    assert set(table) == {(1.0, "ours"), (2.0, "ours"), (4.0, "ours")}
    ratio = table[(2.0, "ours")]["ttft_mean"]
    assert ratio.num == 1 and ratio.median == ratio.low == ratio.high == pytest.approx(0.345 / 0.69)


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
    # one repeat: plain values, no (min-max)
    assert "| chatbot | ours | 1 | 1 | 10 | 0 | 145 / 145 / 189 |" in text
    assert "| chatbot | stock | 4 | 1 | 11 | 1 |" in text
    assert "| chatbot | ours | 2 |" in text.split("Peak load")[1]
    assert "kv 50%, lora 100%" in text and "kv 2048, lora 3072" in text
    assert "| chatbot | 2 | ours | stock | 1 | 0.50x |" in text
    names = sorted(p.name for p in pngs)
    assert names == ["memory_chatbot_sim_elora.png", "ttft_vs_rate_chatbot.png"]
    for p in pngs:
        assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 5000


def test_bad_results_line_is_named(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(record("ours", 1.0, 0.1, 0)) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"r.jsonl:2: not a RequestResult record"):
        load_results([path])


# Three repeats, arms interleaved as the harness runs them; every request of a replay has the same TTFT, so each
# replay's mean, P50 and P99 TTFT are that value. Per-repeat ratios ours / stock: 0.25, 0.6, 0.8 (median 0.6);
# the ratio of the medians (0.2 / 0.4 = 0.5) or of pooled means (0.2 / 0.3833) would differ.
OURS_TTFT = (0.10, 0.30, 0.20)
STOCK_TTFT = (0.40, 0.50, 0.25)


def repeated_records(num_per_replay: int = 4) -> list[dict]:
    recs = []
    for rep, (ours, stock) in enumerate(zip(OURS_TTFT, STOCK_TTFT)):
        order = [("ours", ours), ("stock", stock)][:: 1 if rep % 2 == 0 else -1]
        for arm, ttft in order:
            recs += [record(arm, 1.0, ttft, i, repeat=rep) for i in range(num_per_replay)]
    return recs


def test_repeats_give_medians_and_per_repeat_ratio_spread(tmp_path):
    summaries = summarize(repeated_records())
    assert [(s.arm, s.num_repeats, s.num) for s in summaries] == [("ours", 3, 12), ("stock", 3, 12)]
    ours, stock = summaries
    assert [r.repeat for r in ours.rows] == [0, 1, 2]
    assert ours.spread("ttft_mean") == Spread(0.2, 0.1, 0.3, 3)
    assert stock.spread("ttft_p99") == Spread(0.4, 0.25, 0.5, 3)
    (ratio,) = ratios(summaries, ["stock"])
    assert ratio["num_repeats"] == 3
    assert ratio["ttft_mean"] == Spread(pytest.approx(0.6), pytest.approx(0.25), pytest.approx(0.8), 3)
    # the peak load goes by the median: stock's best repeat (0.25 s) is under 0.3 s, its median (0.4 s) is not
    assert peak_load(summaries, 0.3) == {("chatbot", "ours"): 1.0, ("chatbot", "stock"): None}

    md, pngs = write_report(repeated_records(), tmp_path, ["stock"], slo_s=0.5)
    text = md.read_text()
    assert "| chatbot | ours | 1 | 3 | 12 | 0 | 200 (100-300) / 200 (100-300) / 200 (100-300) |" in text
    assert "| chatbot | stock | 1 | 3 | 12 | 0 | 400 (250-500) /" in text
    assert "| 20.0 (10.0-30.0) / 20.0 (10.0-30.0) | lora 40% (40-40%) |" in text  # TPOT = TTFT / 10
    assert "| chatbot | 1 | ours | stock | 3 | 0.60x (0.25-0.80x) | 0.60x (0.25-0.80x) |" in text
    assert [p.name for p in pngs] == ["ttft_vs_rate_chatbot.png"]
    assert pngs[0].read_bytes()[:8] == PNG_MAGIC


def test_ratios_use_only_repeats_both_arms_ran():
    """A run stopped early (the baseline unreachable in repeat 3) leaves ours with a repeat stock lacks."""
    recs = repeated_records(2) + [record("ours", 1.0, 5.0, i, repeat=3) for i in range(2)]
    ours, stock = summarize(recs)
    assert ours.num_repeats == 4 and stock.num_repeats == 3
    assert ours.spread("ttft_mean") == Spread(pytest.approx(0.25), 0.1, 5.0, 4)
    (ratio,) = ratios([ours, stock], ["stock"])
    assert ratio["num_repeats"] == 3 and ratio["ttft_mean"].high == pytest.approx(0.8)


def test_memory_plot_takes_one_repeat_per_rate(tmp_path):
    """Replays of several repeats on one time axis would interleave: the plot shows the lowest repeat only."""
    recs = [
        record("ours", 1.0, 0.1, i, repeat=rep, memory_bytes={"kv": 2**20 * (rep + i)}, memory_t_s=float(2 - i))
        for rep in (2, 1)
        for i in range(3)
    ]
    series = memory_series(recs)
    assert series == {("chatbot", "ours"): {1.0: (1, [(0.0, {"kv": 3 * 2**20}), (1.0, {"kv": 2 * 2**20}),
                                                       (2.0, {"kv": 2**20})])}}
    md, pngs = write_report(recs, tmp_path, ["stock"])
    assert sorted(p.name for p in pngs) == ["memory_chatbot_ours.png", "ttft_vs_rate_chatbot.png"]
    # the table's peak memory is per repeat: repeat 1 peaks at 3 MiB, repeat 2 at 4 MiB
    assert "| kv 4 (3-4) |" in md.read_text()


def unified_memory_record(means: dict, p99s: dict, **setup) -> dict:
    """A `unified_memory.py` record of two repeats at one rate (2 req/s): arm -> per-repeat mean and P99 TTFT."""
    runs = [{"arm": arm, "repeat": rep, "time_scale": 1.0, "rate_req_s": 2.0, "num_ok": 10, "num_failed": 0,
             "mean_ttft_s": means[arm][rep], "p50_ttft_s": 1.0, "p99_ttft_s": p99s[arm][rep],
             "cached_token_share": 0.0} for arm in means for rep in (0, 1)]
    setup = {"workload": "translation", "params": {}, "num_requests": 10, "pool_tokens": 6000,
             "stock_buffer_tokens": 2560, "max_loras_per_batch": 4, "max_lora_rank": 64, "stock_kv_tokens": 3440,
             "adapter_bytes_total": 46080, "policy": "elora", "repeats": 2, "time_scales": [1.0], **setup}
    return {"setup": setup, "runs": runs, "device": {}, "date": "2026-11-27T00:00:00"}


def test_unified_memory_report_gives_ratios_against_every_baseline_per_repeat():
    """`eval/bench/unified_memory.py`'s report: arms in order (each -drain variant after its arm), and per-repeat
    ratios of every non-stock arm against each stock arm, figures worked out by hand."""
    from eval.bench.unified_memory import report
    from eval.live.arms import ordered_arms

    assert ordered_arms({"ours-mq", "stock-drain", "ours", "stock", "ours-drain"}) == [
        "stock", "stock-drain", "ours", "ours-drain", "ours-mq"]
    means = {"stock": (2.0, 4.0), "stock-drain": (1.0, 2.0), "ours-mq": (0.5, 1.5)}  # per repeat
    p99s = {"stock": (8.0, 10.0), "stock-drain": (4.0, 5.0), "ours-mq": (2.0, 1.0)}
    text = report(unified_memory_record(means, p99s, arms={"stock": [], "stock-drain": ["--lora-drain-wait-threshold",
                                                                                        "2"]}))
    rows = [line.split(" | ")[1] for line in text.splitlines() if line.startswith("| 2.00 |")]
    assert rows == ["stock", "stock-drain", "ours-mq"]
    # ours-mq / stock: means 0.25 and 0.375 (median 0.3125), P99 0.25 and 0.1 (median 0.175)
    assert "Ratios ours-mq / stock per repeat" in text and "mean TTFT 0.31 (0.25-0.38), P99 TTFT 0.17 (0.10-0.25)" in text
    # ours-mq / stock-drain: means 0.5 and 0.75, P99 0.5 and 0.2
    assert "Ratios ours-mq / stock-drain per repeat" in text
    assert "mean TTFT 0.62 (0.50-0.75), P99 TTFT 0.35 (0.20-0.50)" in text
    assert "Ratios stock-drain / stock" not in text  # baselines are not compared with each other


def test_unified_memory_arms_with_their_own_cap_and_the_headline_against_the_better_stock_arm():
    """`<arm>-cap<N>`: a stock arm's KV shrinks by the slot buffers of its own cap, ours keep every slot and only
    change `--max-loras-per-batch`; the headline compares each of our arms with the stock arm of the lower median
    mean TTFT at each rate, whichever cap or drainer it has (figures worked out by hand)."""
    import argparse
    from types import SimpleNamespace

    from eval.bench.unified_memory import report
    from eval.live.arms import arm_spec, ordered_arms, parse_arm, stock_buffer_tokens

    assert parse_arm("stock-cap6-drain") == ("stock", 6, True) and parse_arm("ours-mq") == ("ours-mq", None, False)
    for bad in ("stock-cap", "stock-cap0", "stock-capx", "ours-mq-drain-cap8", "theirs", "stock-cap6-drain-drain"):
        with pytest.raises(ValueError, match="unknown arm"):
            parse_arm(bad)
    assert ordered_arms({"ours-mq-cap8", "stock-cap6", "stock-drain", "ours-mq", "stock"}) == [
        "stock", "stock-drain", "stock-cap6", "ours-mq", "ours-mq-cap8"]
    # -hold<X>: the memory-hold share of a multi-queue arm, after the default-share arm of the same cap
    assert parse_arm("ours-mq-cap8-hold0") == ("ours-mq", 8, False)
    assert parse_arm("ours-mq-hold2.5-drain") == ("ours-mq", None, True)
    for bad in ("stock-hold1", "ours-hold1", "ours-mq-hold", "ours-mq-holdx", "ours-mq-hold-1", "ours-mq-hold1-x",
                "ours-mq-hold1-drain-x", "ours-mq-hold0.5-strict", "ours-mq-hold0.5-backfill"):
        with pytest.raises(ValueError, match="unknown arm"):
            parse_arm(bad)
    # -nomove: an arm of ours without KV moves, with any other option
    assert parse_arm("ours-mq-cap8-nomove") == ("ours-mq", 8, False)
    assert parse_arm("ours-mq-cap8-hold0.5-nomove-drain") == ("ours-mq", 8, True)
    with pytest.raises(ValueError, match="unknown arm"):
        parse_arm("stock-cap6-nomove")
    assert ordered_arms({"ours-mq-cap8-nomove", "ours-mq-cap8", "stock"}) == [
        "stock", "ours-mq-cap8", "ours-mq-cap8-nomove"]
    arms = {"ours-mq-cap8-hold2", "ours-mq-cap8-hold0.5", "ours-mq-cap8-hold0", "ours-mq-cap8"}
    assert ordered_arms(arms) == ["ours-mq-cap8", "ours-mq-cap8-hold0", "ours-mq-cap8-hold0.5", "ours-mq-cap8-hold2"]

    workload = SimpleNamespace(adapters=[SimpleNamespace(target_modules=("q_proj", "v_proj"), rank=64)])
    args = argparse.Namespace(max_loras_per_batch=4, pool_tokens=6000, policy="elora", slo_s=2.0, drain_wait_s=2.0)
    per_adapter = 30 * 64 * ((576 + 576) + (576 + 192)) * 4  # layers x rank x (q + v elements per rank) x fp32
    assert stock_buffer_tokens(workload, 6, 64) == -(-6 * per_adapter // 46080)
    tokens, flags = arm_spec("stock-cap6", args, workload, 64)
    assert tokens == 6000 - stock_buffer_tokens(workload, 6, 64) and flags == ["--max-loras-per-batch", "6"]
    tokens, flags = arm_spec("ours-mq-cap8", args, workload, 64)
    assert tokens == 6000 and flags[:2] == ["--max-loras-per-batch", "8"] and "multiqueue" in flags
    assert arm_spec("stock-drain", args, workload, 64)[1][:2] == ["--max-loras-per-batch", "4"]
    tokens, flags = arm_spec("ours-mq-cap8-hold0", args, workload, 64)
    assert tokens == 6000 and flags[-2:] == ["--multilora-memory-hold-share", "0"]
    assert "--multilora-memory-hold-share" not in arm_spec("ours-mq-cap8", args, workload, 64)[1]
    assert arm_spec("ours-mq-cap8-hold0.5", args, workload, 64)[1][-2:] == ["--multilora-memory-hold-share", "0.5"]
    assert arm_spec("ours-mq-cap8-hold0.5-nomove", args, workload, 64)[1][-4:] == [
        "--multilora-memory-hold-share", "0.5", "--multilora-stock-baseline", "kv-moves"]
    assert "--multilora-stock-baseline" not in arm_spec("ours-mq-cap8", args, workload, 64)[1]
    assert arm_spec("ours-mq-cap8-host2.5", args, workload, 64)[1][-2:] == ["--multilora-host-kv-gb", "2.5"]
    assert parse_arm("ours-mq-cap8-nomove-host2-drain") == ("ours-mq", 8, True)
    for bad in ("stock-host2", "ours-mq-host", "ours-mq-host0", "ours-mq-hostx", "ours-mq-host-1"):
        with pytest.raises(ValueError, match="unknown arm"):
            parse_arm(bad)
    for bad in ("ours-mq-overdue2", "ours-mq-room0.5", "ours-mq-protect"):  # rules no longer in the server
        with pytest.raises(ValueError, match="unknown arm"):
            parse_arm(bad)
    with pytest.raises(ValueError, match="more than --pool-tokens 6000"):
        arm_spec("stock-cap40", args, workload, 64)

    means = {"stock": (2.0, 4.0), "stock-cap6": (1.0, 2.0), "ours-mq-cap8": (0.5, 1.5)}  # per repeat
    p99s = {"stock": (8.0, 10.0), "stock-cap6": (4.0, 5.0), "ours-mq-cap8": (2.0, 1.0)}
    text = report(unified_memory_record(means, p99s, arm_tokens={"stock": 3440, "stock-cap6": 2160,
                                                                 "ours-mq-cap8": 6000}))
    assert "KV token slots per arm (`--max-total-tokens`): stock 3440, stock-cap6 2160, ours-mq-cap8 6000." in text
    # stock-cap6's median mean (1.5 s) is below stock's (3.0 s): ratios 0.5 and 0.75, P99 0.5 and 0.2
    assert "- 2.00 req/s, ours-mq-cap8 / stock-cap6: mean TTFT 0.62x (0.50-0.75), P99 TTFT 0.35x (0.20-0.50), " \
           "2 repeats" in text


def test_pooled_tail_takes_every_repeat_together_against_the_stock_arm_with_the_lower_pooled_mean(tmp_path):
    import json

    from eval.live.ttft import pooled_lines, request_ttfts

    raw = tmp_path / "x_requests.jsonl"
    rows = []
    for arm, ttfts in {"stock": [1.0] * 99 + [20.0], "stock-cap6": [2.0] * 100,
                       "ours-mq-cap8": [0.5] * 98 + [4.0, 5.0]}.items():
        rows += [{"arm": arm, "ttft_s": t, "error": None, "extra": {"request_rate": 1.234}} for t in ttfts]
    rows.append({"arm": "ours-mq-cap8", "ttft_s": None, "error": "boom", "extra": {"request_rate": 1.234}})
    raw.write_text("\n".join(json.dumps(r) for r in rows))
    ttfts = request_ttfts(raw)
    assert set(ttfts) == {1.23} and len(ttfts[1.23]["ours-mq-cap8"]) == 100  # the failed request left out
    # stock's pooled mean 1.19 < stock-cap6's 2.0; its P99 (nearest rank 98 of 0..99) is 1.0, ours' 4.0
    [line] = pooled_lines(ttfts)
    assert line == ("- 1.23 req/s, mean / P99 TTFT: stock 1.19 / 1.00 s (n 100); stock-cap6 2.00 / 2.00 s (n 100); "
                    "ours-mq-cap8 0.58 / 4.00 s (n 100), 0.49x / 4.00x stock's")

"""The live multi-queue benchmark's max rate under the TTFT SLO, on a hand-made record: the simulator's definition
(median P99 over repeats within the SLO at every swept rate up to it, interpolated to the next) applied to live runs."""

from __future__ import annotations

import pytest

from eval.bench.multiqueue_live import light_load_lines, light_load_slo, max_rate_lines, merge, p50_floor_lines, report


def _record(p99: dict[str, list[list[float]]], slo_s: float = 2.0, scales=(1.0, 2.0, 3.0), mean_ttft_s: float = 1.0,
            within_slo: float = 0.9) -> dict:
    """p99[arm][i] = the P99 TTFT of each repeat at the i-th time scale (rate = time scale req/s)."""
    scales = list(scales)
    runs = [{"arm": arm, "repeat": rep, "time_scale": scale, "rate_req_s": scale, "num_ok": 10, "num_failed": 0,
             "mean_ttft_s": mean_ttft_s + rep, "p50_ttft_s": 0.5, "p99_ttft_s": v, "mean_e2e_s": 3.0,
             "within_slo": within_slo}
            for arm, per_scale in p99.items() for scale, values in zip(scales, per_scale)
            for rep, v in enumerate(values)]
    setup = {"params": {}, "num_requests": 10, "offered_rate": 1.0, "pool_tokens": 100, "max_lora_rank": 8,
             "slo_s": slo_s, "time_scales": scales, "repeats": 2, "arms": {a: [] for a in p99}}
    return {"setup": setup, "runs": runs, "device": {}, "date": "2026-11-27"}


def test_max_rate_is_the_median_p99_crossing_and_the_ratio_is_of_interpolated_rates():
    record = _record({
        "fcfs": [[1.0, 2.0], [3.0, 5.0], [9.0, 9.0]],  # medians 1.5, 4.0, 9.0: crosses 2 s at 1 + 0.5 / 2.5 = 1.2
        "multiqueue": [[0.5, 0.7], [1.0, 3.0], [4.0, 4.0]],  # medians 0.6, 2.0, 4.0: 2.0 is within; 2 + 0 / 2 = 2.0
    })
    lines = max_rate_lines(record)
    assert "- fcfs: 1.00 req/s swept, 1.20 req/s interpolated" in lines
    assert "- multiqueue: 2.00 req/s swept, 2.00 req/s interpolated" in lines
    assert "- multiqueue / fcfs: 1.67x" in lines
    assert "- multiqueue / fcfs: 1.67x" in report(record)


def test_an_arm_over_the_slo_everywhere_or_within_it_everywhere_is_said_so():
    record = _record({"fcfs": [[3.0, 3.0], [5.0, 5.0], [9.0, 9.0]], "multiqueue": [[1.0, 1.0], [1.0, 1.5], [1.9, 1.0]]})
    lines = max_rate_lines(record)
    assert "- fcfs: none (P99 above the SLO already at 1.00 req/s)" in lines
    assert "- multiqueue: at least 3.00 req/s (every swept rate)" in lines
    assert not any(line.startswith("- multiqueue / fcfs") for line in lines)  # no rate for fcfs: no ratio


def test_a_ratio_with_one_arm_sustaining_every_rate_is_a_lower_bound_of_swept_rates():
    record = _record({"fcfs": [[1.0, 1.0], [5.0, 5.0], [9.0, 9.0]], "multiqueue": [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]})
    (line,) = [x for x in max_rate_lines(record) if x.startswith("- multiqueue / fcfs")]
    assert line.startswith("- multiqueue / fcfs: 3.00x (of swept rates; at least that")


def test_chameleons_rule_is_five_times_the_baselines_mean_ttft_at_the_lowest_rate():
    # fcfs's mean TTFT at 1 req/s is 0.5 and 1.5 over the two repeats: median 1.0, SLO 5.0 s
    record = _record({"fcfs": [[1.0, 2.0], [3.0, 5.0], [9.0, 9.0]], "multiqueue": [[0.5, 0.7], [1.0, 3.0], [4.0, 4.0]]},
                     mean_ttft_s=0.5, within_slo=1.0)
    assert light_load_slo(record) == ("fcfs", 1.0, 1.0, 5.0)
    lines = light_load_lines(record)
    assert "an SLO of 5 s" in lines[1]
    # fcfs medians 1.5, 4.0, 9.0 cross 5 s at 2 + 1 / 5; multiqueue's 4.0 at 3 req/s is within
    assert "- fcfs: 2.00 req/s swept, 2.20 req/s interpolated" in lines
    assert "- multiqueue: at least 3.00 req/s (every swept rate)" in lines
    assert "an SLO of 5 s" in report(record)


def test_no_light_load_slo_where_the_lowest_rate_already_misses_the_records_slo():
    record = _record({"fcfs": [[1.0, 2.0], [3.0, 5.0], [9.0, 9.0]], "multiqueue": [[0.5, 0.7], [1.0, 3.0], [4.0, 4.0]]},
                     within_slo=0.98)
    assert light_load_slo(record) is None
    assert "gives no SLO here" in light_load_lines(record)[1]


def test_merge_joins_a_sweep_split_into_runs_and_refuses_other_differences():
    low = _record({"fcfs": [[1.0, 1.0], [1.5, 1.5]], "multiqueue": [[1.0, 1.0], [1.2, 1.2]]}, scales=(1.0, 2.0))
    high = _record({"fcfs": [[4.0, 4.0]], "multiqueue": [[1.8, 1.8]]}, scales=(3.0,))
    merged = merge([low, high])
    assert merged["setup"]["time_scales"] == [1.0, 2.0, 3.0]
    assert len(merged["runs"]) == len(low["runs"]) + len(high["runs"])
    assert [m["time_scales"] for m in merged["merged_from"]] == [[1.0, 2.0], [3.0]]
    # fcfs: 1.5 at 2 req/s, 4.0 at 3: crosses 2 s at 2.2; multiqueue sustains every rate
    assert "- fcfs: 2.00 req/s swept, 2.20 req/s interpolated" in max_rate_lines(merged)
    assert "Merged from 2 runs" in report(merged)
    assert "over the last of the merged runs" in report({**merged, "multiqueue_stats_at_end": {"counts": {}}})
    other = _record({"fcfs": [[4.0, 4.0]], "multiqueue": [[1.8, 1.8]]}, scales=(3.0,), slo_s=3.0)
    with pytest.raises(ValueError, match="slo_s"):
        merge([low, other])
    with pytest.raises(ValueError, match=r"time scales \[2.0\] are in more than one run"):
        merge([low, _record({"fcfs": [[4.0, 4.0]], "multiqueue": [[1.8, 1.8]]}, scales=(2.0,))])


def test_the_p50_floor_is_the_light_load_median_over_the_baselines_median_where_it_misses_the_slo():
    record = _record({"fcfs": [[1.0, 1.0], [3.0, 5.0], [9.0, 9.0]], "multiqueue": [[1.0, 1.0], [1.0, 1.5], [1.9, 1.0]]})
    p50 = {("fcfs", 1.0): [0.6, 0.8], ("multiqueue", 1.0): [0.5, 0.9], ("fcfs", 2.0): [1.2, 1.6],
           ("fcfs", 3.0): [2.0, 2.0], ("multiqueue", 2.0): [0.7, 0.7], ("multiqueue", 3.0): [0.8, 0.8]}
    for r in record["runs"]:
        r["p50_ttft_s"] = p50[r["arm"], r["rate_req_s"]][r["repeat"]]
    # light-load medians 0.7 (both arms); fcfs misses 2 s at 2 and 3 req/s (medians 4.0, 9.0), P50 medians 1.4, 2.0
    (line,) = [x for x in p50_floor_lines(record) if x]
    assert line.startswith("P50 TTFT at light load: 0.70 s (the lowest arm's median at 1.00 req/s)")
    assert line.endswith("reach is about 0.50 at 2.00 req/s, 0.35 at 3.00 req/s.")
    assert line in report(record)
    # no baseline rate past the SLO: no floor to give
    assert p50_floor_lines(_record({"fcfs": [[1.0, 1.0]], "multiqueue": [[1.0, 1.0]]}, scales=(1.0,))) == []

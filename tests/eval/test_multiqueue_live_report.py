"""The live multi-queue benchmark's max rate under the TTFT SLO, on a hand-made record: the simulator's definition
(median P99 over repeats within the SLO at every swept rate up to it, interpolated to the next) applied to live runs."""

from __future__ import annotations

from eval.bench.multiqueue_live import max_rate_lines, report


def _record(p99: dict[str, list[list[float]]], slo_s: float = 2.0) -> dict:
    """p99[arm][i] = the P99 TTFT of each repeat at the i-th time scale (rate = time scale req/s)."""
    scales = [1.0, 2.0, 3.0]
    runs = [{"arm": arm, "repeat": rep, "time_scale": scale, "rate_req_s": scale, "num_ok": 10, "num_failed": 0,
             "mean_ttft_s": 1.0, "p50_ttft_s": 0.5, "p99_ttft_s": v, "mean_e2e_s": 3.0, "within_slo": 0.9}
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

"""The TTFT floor benchmark's pure parts: a request made to run alone, and the comparison with load runs."""

from eval.bench.ttft_floor import alone, compare_lines, report
from eval.workloads import create_workload


def test_a_request_alone_arrives_at_zero_and_keeps_its_adapter_and_lengths():
    w = create_workload("translation", seed=0, num_requests=12, num_adapters=4, ranks=(16,), length_scale=0.1)
    r = w.requests[5]
    one = alone(w, r)
    assert len(one.requests) == 1 and one.requests[0].arrival_s == 0.0
    assert (one.requests[0].rid, one.requests[0].adapter, one.requests[0].new_tokens) == (r.rid, r.adapter,
                                                                                          r.new_tokens)
    warm = alone(w, r, rid="warm", new_tokens=4, output_tokens=1)
    assert warm.requests[0].adapter == r.adapter and warm.requests[0].new_tokens == 4
    one.check_invariants()


def _run(arm, rate, mean):
    return {"arm": arm, "rate_req_s": rate, "mean_ttft_s": mean}


def test_the_comparison_takes_the_best_stock_arm_per_rate_and_halves_it():
    floor_rows = [{"ttft_s": 0.4}, {"ttft_s": 0.6}, {"ttft_s": None}]  # a failed request is left out: floor 0.5
    record = {"runs": [_run("stock", 1.0, 0.9), _run("stock", 1.0, 1.1), _run("stock-drain", 1.0, 0.8),
                       _run("stock-drain", 1.0, 0.8), _run("ours-mq", 1.0, 0.7), _run("ours-mq", 1.0, 0.6),
                       _run("stock", 2.0, 3.0), _run("stock-drain", 2.0, 4.0), _run("ours-mq", 2.0, 1.5)]}
    lines = compare_lines(floor_rows, [("r.jsonl", record)])
    assert lines[2] == "| r.jsonl | 1.00 | 0.80 (stock-drain) | 0.40 | 0.50 | 0.65 |"
    assert lines[3] == "| r.jsonl | 2.00 | 3.00 (stock) | 1.50 | 0.50 | 1.50 |"
    text = report({"setup": {"workload": "translation", "params": {}, "seed": 0, "arm": "stock", "arm_flags": [],
                             "max_total_tokens": 100},
                   "device": {}, "date": "2026-11-27T00:00:00", "floors": floor_rows, "compare": lines})
    assert "mean TTFT 0.500 s" in text and "failed 1" in text and "| r.jsonl | 2.00 |" in text

"""eval/bench/pooled.py: every repeat's requests of a request log together, per rate and arm, against a baseline."""

import json

from eval.bench.pooled import pooled_lines, request_ttfts


def _log(tmp_path, rows):
    path = tmp_path / "run_requests.jsonl"
    path.write_text("".join(json.dumps({"arm": arm, "ttft_s": ttft, "error": err,
                                        "extra": {"request_rate": rate}}) + "\n"
                            for arm, rate, ttft, err in rows))
    return path


def test_pools_repeats_by_rate_and_arm_and_skips_failed_requests(tmp_path):
    rows = [("fcfs", 1.004, t, None) for t in (1.0, 2.0, 3.0, 4.0)]
    rows += [("multiqueue", 0.998, t, None) for t in (1.0, 1.0, 1.0, 2.0)]
    rows += [("multiqueue", 1.0, None, "HTTP 500"), ("fcfs", 2.0, 9.0, None)]
    ttfts = request_ttfts(_log(tmp_path, rows))
    assert ttfts == {1.0: {"fcfs": [1.0, 2.0, 3.0, 4.0], "multiqueue": [1.0, 1.0, 1.0, 2.0]}, 2.0: {"fcfs": [9.0]}}
    lines = pooled_lines(ttfts, "fcfs")
    # mean 1.25 / 2.5 = 0.5; P99 by nearest rank: the slowest of four, 2.0 / 4.0
    assert lines[0] == ("- 1.00 req/s, mean / P99 TTFT: fcfs 2.50 / 4.00 s (n 4); "
                        "multiqueue 1.25 / 2.00 s (n 4), 0.50x / 0.50x fcfs's")
    assert lines[1] == "- 2.00 req/s, mean / P99 TTFT: fcfs 9.00 / 9.00 s (n 1)"


def test_baseline_prefix_takes_the_arm_with_the_lowest_pooled_mean(tmp_path):
    rows = [("stock", 1.0, 4.0, None), ("stock-cap6", 1.0, 2.0, None), ("ours-mq-cap8", 1.0, 1.0, None)]
    [line] = pooled_lines(request_ttfts(_log(tmp_path, rows)), "stock")
    assert "ours-mq-cap8 1.00 / 1.00 s (n 1), 0.50x / 0.50x stock-cap6's" in line

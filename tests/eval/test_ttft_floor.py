"""The TTFT floor benchmark's pure parts: a request made to run alone, sessions as chains of turns, and the
comparison with load runs."""

import dataclasses

import pytest

from eval.bench.ttft_floor import alone, chains, compare_lines, pooled_compare_lines, report, request_logs
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


def test_sessions_become_chains_of_turns_in_order_and_a_broken_chain_is_named():
    w = create_workload("chatbot", seed=3, num_conversations=6, num_adapters=4, ranks=(16,))
    got = chains(w)
    assert sorted(r.rid for turns in got for r in turns) == sorted(r.rid for r in w.requests)
    assert any(len(turns) > 1 for turns in got)
    for turns in got:
        assert len({r.session for r in turns}) == 1 and turns[0].parent_rid is None
        assert [r.parent_rid for r in turns[1:]] == [r.rid for r in turns[:-1]]
        assert len({r.adapter for r in turns}) == 1
    t = create_workload("translation", seed=0, num_requests=12, num_adapters=4, ranks=(16,), length_scale=0.1)
    assert [len(turns) for turns in chains(t)] == [1] * 12
    later = next(r for r in w.requests if r.parent_rid is not None)
    broken = dataclasses.replace(w, requests=tuple(dataclasses.replace(r, parent_rid="elsewhere")
                                                   if r is later else r for r in w.requests))
    with pytest.raises(SystemExit, match=f"session {later.session}: request {later.rid} does not continue"):
        chains(broken)


def _run(arm, rate, mean, p99=None):
    return {"arm": arm, "rate_req_s": rate, "mean_ttft_s": mean, "p99_ttft_s": 2 * mean if p99 is None else p99}


def test_the_comparison_takes_the_best_stock_arm_per_rate_halves_its_mean_and_quarters_its_p99():
    # a failed request is left out: floor mean 0.5, P99 (nearest rank of 0.4, 0.6) 0.6
    floor_rows = [{"ttft_s": 0.4}, {"ttft_s": 0.6}, {"ttft_s": None}]
    record = {"runs": [_run("stock", 1.0, 0.9), _run("stock", 1.0, 1.1), _run("stock-drain", 1.0, 0.8, 4.0),
                       _run("stock-drain", 1.0, 0.8, 2.0), _run("ours-mq", 1.0, 0.7, 1.0),
                       _run("ours-mq", 1.0, 0.6, 1.2), _run("stock", 2.0, 3.0), _run("stock-drain", 2.0, 4.0),
                       _run("ours-mq", 2.0, 1.5, 2.2)]}
    lines = compare_lines(floor_rows, [("r.jsonl", record)])
    assert lines[2] == ("| r.jsonl | 1.00 | stock-drain | 0.80 / 0.40 | 0.50 | 3.00 / 0.75 | 0.60 | "
                        "ours-mq 0.65 / 1.10 |")
    assert lines[3] == "| r.jsonl | 2.00 | stock | 3.00 / 1.50 | 0.50 | 6.00 / 1.50 | 0.60 | ours-mq 1.50 / 2.20 |"
    text = report({"setup": {"workload": "translation", "params": {}, "seed": 0, "arm": "stock", "arm_flags": [],
                             "max_total_tokens": 100},
                   "device": {}, "date": "2026-11-27T00:00:00", "floors": floor_rows, "compare": lines})
    assert "mean TTFT 0.500 s" in text and "failed 1" in text and "| r.jsonl | 2.00 |" in text


def test_the_pooled_comparison_sets_every_repeats_requests_against_the_floors_repeated():
    # 62 floors, one slow even alone (a long prompt): one run's P99 (nearest rank 60 of 0..61) is a fast request's
    # floor, but over 3 repeats the slow one's three copies are the pooled set's slowest and rank 183 of 0..185 is one
    floor_rows = [{"ttft_s": 0.5}] * 61 + [{"ttft_s": 2.0}, {"ttft_s": None}]
    ttfts = {1.5: {"stock": [1.0] * 180 + [4.0, 5.0, 6.0, 7.0, 8.0, 9.0], "stock-cap6": [2.0] * 186,
                   "ours-mq": [0.4] * 183 + [2.1, 2.2, 2.5]},
             3.0: {"ours-mq": [1.0]}}  # no stock arm at this rate: no line
    lines = pooled_compare_lines(floor_rows, [("r.jsonl", ttfts, 3)])
    assert lines[2:] == ["| r.jsonl | 1.50 | stock | 1.18 / 0.59 | 0.52 | 7.00 / 1.75 | 2.00 | ours-mq 0.43 / 2.10 |"]
    assert compare_lines(floor_rows, [("r.jsonl", {"runs": [_run("stock", 1.5, 1.0)]})])[2].endswith(
        "| 0.50 |  |")  # the run-level floor P99 is a fast request's
    text = report({"setup": {"workload": "chatbot", "params": {}, "seed": 1, "arm": "ours", "arm_flags": [],
                             "max_total_tokens": 100},
                   "device": {}, "date": "2026-11-30T00:00:00", "floors": floor_rows, "compare": None,
                   "compare_pooled": lines})
    assert "pooled figures" in text and lines[2] in text


def test_request_logs_reads_the_log_beside_each_record_and_skips_a_record_without_one(tmp_path):
    import json

    with_log, without = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for path in (with_log, without):
        path.write_text(json.dumps({"setup": {"repeats": 2}, "runs": []}) + "\n")
    rows = [{"arm": "stock", "ttft_s": 1.25, "error": None, "extra": {"request_rate": 0.984}},
            {"arm": "stock", "ttft_s": None, "error": "HTTP 500", "extra": {"request_rate": 0.984}}]
    (tmp_path / "a_requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert request_logs([with_log, without]) == [("a.jsonl", {0.98: {"stock": [1.25]}}, 2)]

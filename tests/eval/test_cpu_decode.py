"""`eval.bench.cpu_decode`'s report: per-round ratios (stock / ours for the op, ours / stock for the server) worked out
by hand, and the bench's trace lengths."""

from __future__ import annotations

from eval.bench import cpu_decode


def test_report_ratios():
    op = {"part": "op", "case": "8 x 512", "batch": 8, "kv_tokens": 4096, "max_len": 512, "groups": 1,
          "step_ms": {"stock": [90.0, 120.0, 100.0], "ours": [30.0, 30.0, 50.0], "ours-pad0": [31.0, 32.0, 33.0]}}

    def burst(tpot, wall):
        return {"tpot_s": tpot, "wall_s": wall}

    server = {"part": "server", "streams": 4, "tokens": 8, "prompt_words": [40, 100, 7, 300],
              "rounds": [{"stock": burst(0.4, 20.0), "ours": burst(0.3, 16.0), "tokens_equal": True},
                         {"stock": burst(0.5, 25.0), "ours": burst(0.25, 20.0), "tokens_equal": False}]}
    record = {"setup": {"rounds": 3, "torch_threads": 2, "argv": "--rounds 3 --server"},
              "device": {"cpu_count": 2, "load_avg_start": [0.1], "load_avg_end": [1.5]}, "date": "2026-11-29T00:00",
              "rows": [op, server]}
    text = cpu_decode.report(record)
    # op: 90/30 = 3, 120/30 = 4, 100/50 = 2 -> median 3; pad0's column is its own times
    assert "| 8 x 512 | 8 | 4096 | 512 | 1 | 100.00 (90.00-120.00) | 30.00 (30.00-50.00) | 32.00 (31.00-33.00) | " \
           "3.00 (2.00-4.00) |" in text
    # server: TPOT 0.3 / 0.4 = 0.75, 0.25 / 0.5 = 0.5; wall 16 / 20 = 0.8, 20 / 25 = 0.8
    assert "TPOT 0.62 (0.50-0.75), wall 0.80 (0.80-0.80); greedy tokens equal in 1 of 2 rounds" in text
    assert "prompts of 7-300 words" in text
    assert "| stock | 450.0 (400.0-500.0) | 22.50 (20.00-25.00) |" in text


def test_trace_lengths_follow_the_scale():
    short = cpu_decode.trace_lengths(50, 0.1, seed=3)
    long = cpu_decode.trace_lengths(50, 1.0, seed=3)
    assert len(short) == 50 and min(short) >= 1
    assert sum(long) > 5 * sum(short)  # the same draws, ten times the prompt part

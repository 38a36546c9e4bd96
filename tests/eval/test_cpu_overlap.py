"""`eval.bench.cpu_overlap`'s report: the per-round ratios (off / on, of each round's medians) worked out by hand."""

from __future__ import annotations

from eval.bench import cpu_overlap


def test_report_ratios():
    def arm(alone, loaded, tpot):
        return {"alone_ttft_s": alone, "loaded_ttft_s": loaded, "background_tpot_s": tpot}

    rounds = [{"overlap": arm([0.5, 0.6, 0.7], [0.6, 0.8], [0.3, 0.3]),
               "no-overlap": arm([0.3, 0.3, 0.4], [0.3, 0.3], [0.3, 0.3]), "tokens_equal": True},
              {"overlap": arm([0.4], [1.0], [0.2]), "no-overlap": arm([0.2], [0.4], [0.3]), "tokens_equal": False}]
    record = {"setup": {"pool_tokens": 12000, "argv": "--rounds 2"},
              "device": {"cpu_count": 2, "load_avg_start": [1.0], "load_avg_end": [1.5]}, "date": "2026-11-29T00:00",
              "rows": {"adapters": ["a"] * 10, "probes": 3, "background": 2, "background_tokens": 8,
                       "rounds": rounds}}
    text = cpu_overlap.report(record)
    # alone: 0.3 / 0.6 = 0.5, 0.2 / 0.4 = 0.5; loaded: 0.3 / 0.7 = 0.43, 0.4 / 1.0 = 0.4; TPOT 1.0 and 1.5
    assert "probe TTFT alone 0.50 (0.50-0.50), loaded 0.41 (0.40-0.43); background TPOT 1.25 (1.00-1.50)" in text
    assert "tokens equal between the arms in 1 of 2 rounds" in text
    assert "| `overlap` | 0.50 (0.40-0.60) | 0.85 (0.70-1.00) | 0.25 (0.20-0.30) |" in text

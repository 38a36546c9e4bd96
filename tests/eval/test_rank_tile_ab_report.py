"""The rank-tile A/B report from a hand-made record: ratios grouped by rank, phase and module; the rank-64 control
reported apart from the one-tile shapes."""

from eval.bench.rank_tile_ab import report, shapes


def _row(rank, phase, module, one, general):
    return {"setup": {"rank": rank, "phase": phase, "module": module, "one_tile": rank <= 32},
            "latency_us": {"one_tile": one, "general": general}}


def test_report_groups_ratios_and_keeps_the_control_apart():
    record = {"device": "GPU X", "date": "2026-11-27T00:00:00", "versions": {"torch": "t", "triton": "tr"},
              "command": "cmd", "note": "note.",
              "results": [_row(16, "decode", "qkv", 9.0, 10.0), _row(16, "decode", "qkv", 7.0, 10.0),
                          _row(32, "prefill", "o", 5.0, 10.0), _row(64, "decode", "qkv", 10.0, 10.0)]}
    text = report(record)
    assert "| 16 | decode | qkv | 0.80 (0.70-0.90) | 2 |" in text
    assert "| 32 | prefill | o | 0.50 (0.50-0.50) | 1 |" in text
    assert "Ranks within one tile (3 shapes): 0.70 (0.50-0.90); faster on 3." in text
    assert "Rank 64, the same launch in both arms (the run's noise, 1 shapes): 1.00 (1.00-1.00)." in text


def test_every_rank_and_module_has_its_core_shapes_first():
    s = shapes()
    core = [x for x in s if x[2] in (1, 32, 256, 2048) and x[3] in (1, 8)]
    assert s[:len(core)] == core
    assert {(x[0], x[1]) for x in core} == {(m, r) for m in ("qkv", "o", "gate_up", "down") for r in (16, 32, 8, 64)}

"""The plugin-overhead benchmark's pure parts on synthetic records: round order, aggregation,
ratios, the Markdown summary and its conclusion, the py-spy stack summary. No server is started."""

from __future__ import annotations

import pytest

from eval.bench.plugin_overhead_report import (
    METRICS,
    aggregate,
    cost,
    ratios,
    render_markdown,
    render_profile_markdown,
    round_order,
    summarize_stacks,
)

ARMS = ["no-plugin", "plugin", "plugin+tree"]
# per arm, per repeat: (mean TTFT ms, mean TPOT ms, output tokens/s)
VALUES = {
    "no-plugin": [(100.0, 50.0, 10.0), (120.0, 60.0, 8.0), (110.0, 55.0, 9.0)],
    "plugin": [(104.0, 50.0, 10.0), (126.0, 61.0, 8.0), (111.0, 55.0, 9.0)],
    "plugin+tree": [(150.0, 50.0, 5.0), (180.0, 60.0, 4.0), (160.0, 55.0, 4.5)],
}


def records() -> list[dict]:
    out = []
    for repeat in range(3):
        for arm in round_order(ARMS, repeat):
            ttft, tpot, throughput = VALUES[arm][repeat]
            out.append(
                {
                    "setup": {
                        "arm": arm,
                        "repeat": repeat,
                        "arms": ARMS,
                        "repeats": 3,
                        "servers": "persistent",
                        "command": "python -m eval.bench.plugin_overhead",
                        "bench_serving": "python -m sglang...",
                        "server_args": ["--device", "cpu"],
                        "arm_setup": {a: f"setup of {a}" for a in ARMS},
                    },
                    "machine": {
                        "cpu_model": "Test CPU",
                        "nproc": 2,
                        "git_commit": "abc123",
                        "load_average_start": [1.0 + repeat, 1.0, 1.0],
                        "load_average_end": [2.0, 1.0, 1.0],
                    },
                    "date": "2026-11-24T00:00:00+00:00",
                    "measurements": {
                        "mean_ttft_ms": ttft,
                        "mean_tpot_ms": tpot,
                        "output_throughput": throughput,
                        "scheduler_cpu_s": 10.0 + repeat,
                    },
                }
            )
    return out


def test_round_order_rotates_the_arms_once_per_repeat():
    assert round_order(ARMS, 0) == ["no-plugin", "plugin", "plugin+tree"]
    assert round_order(ARMS, 1) == ["plugin", "plugin+tree", "no-plugin"]
    assert round_order(ARMS, 2) == ["plugin+tree", "no-plugin", "plugin"]
    assert round_order(ARMS, 3) == round_order(ARMS, 0)


def test_aggregate_gives_median_min_max_per_arm_and_metric():
    summary = aggregate(records())
    ttft = summary["no-plugin"]["mean_ttft_ms"]
    assert (ttft.median, ttft.low, ttft.high, ttft.n) == (110.0, 100.0, 120.0, 3)
    assert summary["plugin+tree"]["output_throughput"].median == 4.5
    assert "median_ttft_ms" not in summary["plugin"]  # absent from the records: no entry


def test_ratio_is_of_medians_and_its_spread_pairs_repeats():
    rel = ratios(records())
    assert "no-plugin" not in rel
    plugin = rel["plugin"]["mean_ttft_ms"]
    assert plugin.median == pytest.approx(111 / 110)
    assert plugin.low == pytest.approx(111 / 110)  # repeat 2: 111 / 110
    assert plugin.high == pytest.approx(126 / 120)  # repeat 1: 1.05
    tree = rel["plugin+tree"]["output_throughput"]
    assert (tree.median, tree.low, tree.high) == pytest.approx((0.5, 0.5, 0.5))


def test_cost_reads_throughput_the_other_way_round():
    by_key = {m.key: m for m in METRICS}
    assert cost(by_key["mean_ttft_ms"], 1.10) == pytest.approx(0.10)
    assert cost(by_key["output_throughput"], 0.5) == pytest.approx(
        1.0
    )  # half the throughput: 100% worse
    assert cost(by_key["output_throughput"], 1.25) == pytest.approx(-0.2)


def test_markdown_table_and_conclusion_come_from_the_numbers():
    md = render_markdown(records())
    assert (
        "| mean TTFT (ms) | 110.0 [100.0, 120.0] | 111.0 [104.0, 126.0] | 160.0 [150.0, 180.0] | "
        in md
    )
    assert "1.009 [1.009, 1.050]" in md  # plugin / no-plugin, mean TTFT
    assert "0.500 [0.500, 0.500]" in md  # plugin+tree / no-plugin, output throughput
    assert "`plugin` meets the 5% goal" in md
    assert "mean TTFT (ms): 0.9% worse (within the 5% budget; all 3 repeats on one side of 1)" in md
    assert "`plugin+tree` misses the 5% goal" in md
    assert (
        "CPU seconds for the same requests: scheduler CPU time (s): 0.0% apart "
        "(within the 5% budget; repeats on both sides of 1)"
    ) in md
    assert "output throughput (tok/s): 100.0% worse (over the 5% budget" in md
    assert "load average (1 min) 1.00 to 3.00" in md
    assert "over its 3 repeats: mean TTFT (ms) 20%" in md  # the baseline's own spread: 120 / 100
    assert "- 3 repeats, arms interleaved" in md
    # one side in every repeat: plugin's TTFT, plugin+tree's TTFT and throughput; at 1 in some
    # repeat: plugin's TPOT and throughput, plugin+tree's TPOT
    assert "Of the 6 ratios above (arm x the goal's three metrics), 3 have every repeat" in md
    interrupted = [r for r in records() if r["setup"]["repeat"] < 2]
    assert "- 2 repeats (of 3 planned), arms interleaved" in render_markdown(interrupted)


def test_an_arm_faster_than_the_baseline_meets_the_budget():
    base = {
        r["setup"]["repeat"]: r["measurements"]
        for r in records()
        if r["setup"]["arm"] == "no-plugin"
    }
    # plugin: 20% lower TTFT and TPOT than no-plugin in every repeat, the same throughput
    faster = [
        {
            **r,
            "measurements": {
                k: v * (1.0 if k == "output_throughput" else 0.8)
                for k, v in base[r["setup"]["repeat"]].items()
            },
        }
        if r["setup"]["arm"] == "plugin"
        else r
        for r in records()
    ]
    md = render_markdown(faster)
    assert (
        "`plugin` meets the 5% goal: mean TTFT (ms): 20.0% better (better than the 5% budget; "
        "all 3 repeats on one side of 1)"
    ) in md


def test_markdown_without_a_baseline_record_has_no_ratios():
    md = render_markdown([r for r in records() if r["setup"]["arm"] == "plugin"])
    assert "| mean TTFT (ms) | 111.0 [104.0, 126.0] |" in md
    assert "meets" not in md and "misses" not in md and "Noise" not in md


def test_stack_summary_splits_processes_steps_and_our_frames():
    sched = "run_scheduler_process (scheduler.py:1);Scheduler.run_batch (scheduler.py:2)"
    extend = sched + ";EagerRunner._execute_extend (runner/eager_runner.py:3)"
    raw = "\n".join(
        [
            extend + ";run_sdpa_forward_extend (patches/cpu_extend_attention.py:37);"
            "sdpa_forward_extend (patches/cpu_extend_attention.py:90) 30",
            extend
            + ";TorchNativeAttnBackend._run_sdpa_forward_extend (torch_native_backend.py:9) 10",
            sched + ";EagerRunner._execute_decode (runner/eager_runner.py:4) 50",
            sched + ";MultiLoRARadixCache.checkpoint (patches/radix_backend.py:133);"
            "LoraRadixTree.insert (sgl_multilora/tree.py:202) 10",
            "run_detokenizer_process (detokenizer_manager.py:5);recv (zmq.py:1) 20",
            "uvloop_run (server.py:1);validate_one_request (patches/ingress.py:130) 5",
            "uvloop_run (server.py:1);TokenizerManager.generate (tokenizer_manager.py:1) 15",
            "not a sample line",
        ]
    )
    summary = summarize_stacks(raw)
    assert summary["samples"] == {"scheduler": 100, "detokenizer": 20, "http": 20}
    assert summary["ours_share"] == {"scheduler": 0.4, "detokenizer": 0.0, "http": 0.25}
    assert summary["scheduler"] == {
        "decode_share": 0.5,
        "extend_attention_share": 0.4,
        "extend_share": 0.4,
    }
    assert summary["ours_by_function"] == {  # by function, whatever line each sample was on
        "scheduler: run_sdpa_forward_extend (patches/cpu_extend_attention.py)": 0.3,
        "scheduler: MultiLoRARadixCache.checkpoint (patches/radix_backend.py)": 0.1,
        "http: validate_one_request (patches/ingress.py)": 0.25,
    }
    record = {
        "setup": {"arm": "plugin+tree", "py_spy": {"rate_hz": 100}, "num_requests": 10},
        "profile": summary,
    }
    table = render_profile_markdown([record])
    assert "| `plugin+tree` | 100 | 40.0% | 40.0% | 50.0% | 0.0% | 40.0% | 25.0% |" in table
    # 10 samples at 100 Hz over 10 requests: 10 ms each
    assert (
        "| `plugin+tree` | `scheduler: MultiLoRARadixCache.checkpoint (patches/radix_backend.py)` "
        "| 10.000% | 10.00 |" in table
    )

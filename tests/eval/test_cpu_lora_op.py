"""`eval.bench.cpu_lora_op`: a real step of the SmolLM2 shapes on both ops agrees, and the reports' ratios are
the ones worked out here by hand."""

from __future__ import annotations

import torch

from eval.bench import cpu_lora_op


def test_one_step_agrees_between_the_ops():
    step = cpu_lora_op.Step(requests=4, tokens=1, adapters=3, ranks=[8, 16], max_slots=4, seed=0)
    ref, got = step.run("torch"), step.run("cpu")
    assert len(ref) == cpu_lora_op.LAYERS * len(cpu_lora_op.MODULES)
    for r, o in zip(ref, got):
        torch.testing.assert_close(o, r, atol=1e-5, rtol=1e-5)
    base = step.run(None)
    assert any(not torch.equal(b, o) for b, o in zip(base, got))  # the adapters did change the outputs


def test_op_report_row():
    row = {"shape": "decode", "requests": 16, "tokens_per_request": 1, "adapters": 8, "max_abs_diff": 0.0,
           "step_s": {"base": [0.1, 0.1, 0.1], "torch": [0.5, 0.5, 0.5], "cpu": [0.3, 0.3, 0.3]},
           "ratio_cpu_over_torch": [0.6, 0.6, 0.6], "lora_ratio_cpu_over_torch": [0.5, 0.5, 0.5]}
    text = cpu_lora_op.report_row(row)
    # LoRA over base: torch (500 - 100) / 100 = 4.00x, cpu (300 - 100) / 100 = 2.00x
    assert "| 4.00x / 2.00x |" in text and "| 0.60 (0.60-0.60) | 0.50 (0.50-0.50) |" in text


def test_server_report_ratios():
    rounds = [{"cpu": {"wall_s": 8.0, "ttft_s": [1.0, 3.0]}, "torch": {"wall_s": 10.0, "ttft_s": [2.0, 2.0]},
               "tokens_equal": True},
              {"cpu": {"wall_s": 9.0, "ttft_s": [2.0, 2.0]}, "torch": {"wall_s": 10.0, "ttft_s": [4.0, 4.0]},
               "tokens_equal": False}]
    record = {"setup": {"pool_tokens": 12000, "max_loras_per_batch": 8, "argv": "--server"},
              "device": {"cpu_count": 2, "load_avg_start": [1.0], "load_avg_end": [1.5]}, "date": "2026-11-29T00:00",
              "rows": {"burst": 2, "new_tokens": 4, "adapters": ["a", "b"], "rounds": rounds}}
    text = cpu_lora_op.server_report(record)
    # burst ratios 0.8 and 0.9 (median 0.85); mean TTFT ratios 2/2 = 1.0 and 2/4 = 0.5 (median 0.75)
    assert "burst wall time 0.85 (0.80-0.90), mean TTFT 0.75 (0.50-1.00)" in text
    assert "tokens equal between the arms in 1 of 2 rounds" in text

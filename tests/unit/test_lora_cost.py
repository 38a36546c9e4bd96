"""The simulator's LoRA step term (eval/sim/lora_cost.py) against measurements it was not fitted to, the kernels'
launch rules it mirrors, and its least-squares solver against closed-form answers."""

from __future__ import annotations

import numpy as np
import pytest

from eval.sim.latency import LatencyModel
from eval.sim.lora_cost import (
    GRID,
    GROUPS,
    _results,
    groups_of,
    layer_batch,
    measured_model,
    measured_us,
    nnls,
)


def test_the_fit_reads_the_kernels_current_tile():
    """The grid was timed at every rank tile the A/B offered; the fit must find the kernels' current RANK_CHUNK among
    them on every row (a tile changed without measuring it again fails here)."""
    from sgl_multilora.triton_kernels import tiles

    rows, layers = _results(GRID)
    assert rows and all(str(tiles.RANK_CHUNK) in r["latency_us"]["rank_chunk"] for r in rows + layers)
    assert all(measured_us(r) == r["latency_us"]["rank_chunk"][str(tiles.RANK_CHUNK)] for r in rows)


def test_predicts_held_out_whole_layers():
    """40 whole layers measured on an H100 (random ranks, targets and popularity; token counts off the grid), none of
    them in the fit: the fitted layer time is within 10% at the median and 30% at P90."""
    _, layers = _results(GRID)
    assert len(layers) >= 30
    model = measured_model()
    err = np.array([abs(model.layer_us(layer_batch(r["layer"])) / measured_us(r) - 1) for r in layers])
    assert np.median(err) < 0.10 and np.percentile(err, 90) < 0.30, err


def test_step_term_scales_with_layers_and_skips_base_tokens():
    lat = LatencyModel()
    every = frozenset(GROUPS)
    one = lat.lora_time([(64, 16, every, 0)])
    assert one == pytest.approx(32 * measured_model().layer_us([(64, 16, every)]) * 1e-6)
    assert lat.lora_time([(64, 16, every, 0), (0, 128, every, 0)]) == one  # an adapter without tokens costs nothing
    attention_only = lat.lora_time([(64, 16, groups_of(("q_proj", "v_proj", "o_proj")), 0)])
    assert 0 < attention_only < one
    mixed = lat.lora_time([(32, 8, every, 0), (32, 128, every, 0)])
    assert lat.lora_time([(64, 8, every, 0)]) < mixed < lat.lora_time([(64, 128, every, 0)]) * 1.5


def test_groups_of_target_modules():
    assert groups_of(("q_proj", "k_proj", "v_proj", "o_proj")) == {"qkv", "o"}
    assert groups_of(("up_proj",)) == {"gate_up"}
    assert groups_of(()) == frozenset()


def test_nnls_matches_least_squares_when_unconstrained_and_clamps_otherwise():
    rng = np.random.default_rng(0)
    a = rng.uniform(0.5, 2.0, size=(40, 3))
    x_true = np.array([1.0, 2.0, 0.5])
    b = a @ x_true
    assert np.allclose(nnls(a, b), x_true, atol=1e-9)
    # b = 1 * col0 - 1 * col1 exactly: the constrained optimum drops col1 and fits col0 alone
    a2 = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    b2 = np.array([1.0, -1.0, 0.0])
    x = nnls(a2, b2)
    assert x[1] == 0.0 and x[0] == pytest.approx(0.5)  # argmin over x0 of (x0 - 1)^2 + 1 + x0^2


def test_benchmark_batches_cover_every_token_and_adapter():
    from eval.bench.lora_step_gpu import compositions, shapes, tokens_per_adapter

    for tokens, adapters in ((1, 1), (4, 4), (64, 16), (1000, 64), (8192, 64)):
        for popularity in ("uniform", "zipf"):
            counts = tokens_per_adapter(tokens, adapters, popularity)
            assert sum(counts) == tokens and len(counts) == adapters and min(counts) >= 1
            if popularity == "zipf" and tokens > 4 * adapters:
                assert counts[0] > counts[-1]
    grid = shapes()
    assert len(grid) == len(set(grid)) and all(n <= t for _, _, t, n, _ in grid)
    for comp in compositions(20):
        assert sum(comp["tokens_per_adapter"]) == comp["num_tokens"]
        assert len(comp["ranks"]) == len(comp["targets"]) == len(comp["tokens_per_adapter"])


def test_benchmark_problem_matches_plain_per_adapter_math():
    """The benchmark's batch (built on CPU here) run through the torch op equals x @ A^T @ B^T adapter by adapter."""
    import torch

    from eval.bench.lora_step_gpu import build
    from sgl_multilora.triton_kernels.ops import lora_forward

    counts, ranks = [5, 2, 1], [8, 16, 128]
    x, _, layout, weights, y, _ = build("qkv", ranks, counts, torch.Generator().manual_seed(0), "cpu", torch.float32)
    out = lora_forward(x, torch.zeros_like(y), layout, weights, impl="torch")
    expected, row = torch.zeros_like(y), 0
    for s, c in enumerate(counts):
        for j, (a, b) in enumerate(zip(weights.a_views[s], weights.b_views[s])):
            lo, hi = weights.slice_offsets[j], weights.slice_offsets[j + 1]
            expected[row:row + c, lo:hi] = (x[row:row + c] @ a.t()) @ b.t()
        row += c
    torch.testing.assert_close(out, expected)


def test_a_rank_wider_than_the_grid_is_costed_with_the_widest_class():
    every = frozenset(GROUPS)
    model = measured_model()
    assert model.layer_us([(64, 256, every)]) > model.layer_us([(64, 128, every)]) > 0

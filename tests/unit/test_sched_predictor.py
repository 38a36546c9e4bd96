"""The output-length predictor learns per (adapter, prompt bucket), falls back to the adapter, then
to all requests, then to the default, and reports its accuracy."""

from __future__ import annotations

import pytest

from sgl_multilora.sched.predictor import OutputLengthPredictor


def test_story_fallbacks_then_learning():
    p = OutputLengthPredictor(default_out_len=256, alpha=0.1, min_samples=3,
                              bucket_edges=(128, 1024))
    assert p.predict("summarise", 50) == 256  # nothing seen: the default

    for _ in range(2):
        p.observe("summarise", 50, 100)
    assert p.predict("summarise", 50) == 256  # two samples are not enough for any key

    p.observe("summarise", 60, 100)
    assert p.predict("summarise", 50) == 100  # (summarise, [0, 128)) answers
    assert p.predict("summarise", 5000) == 100  # other bucket: the adapter's mean
    assert p.predict("classify", 50) == 100  # unknown adapter: all requests
    assert p.predict(None, 50) == 100  # base-model requests are a key like any other

    for _ in range(3):
        p.observe("classify", 500, 4)
    assert p.predict("classify", 500) == 4
    assert p.predict("summarise", 50) == 100  # adapters do not leak into each other
    # all requests: a plain mean while n < 1 / alpha
    assert p.predict("translate", 50) == round((3 * 100 + 3 * 4) / 6)
    p.check_invariants()


def test_exponential_weighting_follows_a_change():
    p = OutputLengthPredictor(alpha=0.25, min_samples=1)
    for _ in range(4):
        p.observe("a", 10, 100)
    assert p.predict("a", 10) == 100
    p.observe("a", 10, 200)
    assert p.predict("a", 10) == 125  # 100 + 0.25 * (200 - 100)
    for _ in range(30):
        p.observe("a", 10, 200)
    assert p.predict("a", 10) == 200


def test_accuracy_over_a_window_uses_the_prediction_that_was_used():
    p = OutputLengthPredictor(window=4)
    p.observe("a", 10, 100, predicted=100)  # exact
    p.observe("a", 10, 100, predicted=120)  # 20% off: within 25%
    p.observe("a", 10, 100, predicted=150)  # 50% off
    s = p.stats()
    assert (s.num_observed, s.window_len) == (3, 3)
    assert s.mae_tokens == pytest.approx(70 / 3)
    assert s.within_25pct == pytest.approx(2 / 3)
    for _ in range(4):
        p.observe("a", 10, 10, predicted=10)  # the window forgets the old errors
    s = p.stats()
    assert (s.num_observed, s.window_len, s.mae_tokens, s.within_25pct) == (7, 4, 0.0, 1.0)
    p.check_invariants()


def test_bad_settings_and_lengths_raise():
    with pytest.raises(ValueError):
        OutputLengthPredictor(alpha=0)
    with pytest.raises(ValueError):
        OutputLengthPredictor(bucket_edges=(10, 5))
    with pytest.raises(ValueError):
        OutputLengthPredictor().observe("a", 10, -1)

"""The comparison with PEFT (`tests/oracle.py`) on made-up outputs: what it accepts, what it rejects, what it counts.

No server and no model: each case builds an `OracleOutput` and a `Served` by hand. Comparisons run inside
`STATS.paused()`, so they leave the run's oracle counts alone. (The shifted aLoRA activation start is checked on real
served outputs in `test_multi_lora_serving.py`, `test_lora_tree.py` and `test_frontend_dsl.py`.)
"""

from __future__ import annotations

import pytest

from tests.oracle import (
    LOGPROB_ATOL,
    NEAR_TIE,
    STATS,
    TOP_K,
    OracleOutput,
    OracleStats,
    Served,
    assert_matches,
)

NUM_TOKENS = 8


def reference(gaps: dict[int, float] | None = None) -> OracleOutput:
    """PEFT's made-up greedy output: token 100 + i at step i, runner-up 200 + i `gaps[i]` below (default 1.0)."""
    gaps = gaps or {}
    tokens, logprobs, top_ids, top_lps, top2 = [], [], [], [], []
    for i in range(NUM_TOKENS):
        gap = gaps.get(i, 1.0)
        ids = [100 + i, 200 + i, *range(300, 300 + 2 * TOP_K - 2)]
        lps = [-0.5, -0.5 - gap, *(-3.0 - j for j in range(2 * TOP_K - 2))]
        tokens.append(ids[0])
        logprobs.append(lps[0])
        top_ids.append(ids)
        top_lps.append(lps)
        top2.append(gap)
    return OracleOutput(tokens, logprobs, top_ids, top_lps, top2, stopped_at_eos=False)


def served_as(oracle: OracleOutput, **changes) -> Served:
    """The server's answer equal to `oracle` (top-k included), then `changes` applied."""
    top = [list(zip(ids[:TOP_K], lps[:TOP_K])) for ids, lps in zip(oracle.top_ids, oracle.top_logprobs)]
    fields = {"tokens": list(oracle.tokens), "logprobs": list(oracle.logprobs), "top": top, **changes}
    return Served(**fields)


def compare(served: Served, oracle: OracleOutput) -> int | None:
    with STATS.paused():
        return assert_matches(served, oracle, "made-up")


def test_equal_outputs_pass_within_the_tolerance():
    ref = reference()
    assert compare(served_as(ref), ref) is None
    nudged = [lp + 0.9 * LOGPROB_ATOL for lp in ref.logprobs]
    assert compare(served_as(ref, logprobs=nudged), ref) is None


def test_a_logprob_beyond_the_tolerance_fails():
    ref = reference()
    logprobs = list(ref.logprobs)
    logprobs[5] += 2 * LOGPROB_ATOL
    with pytest.raises(AssertionError, match="token 5: logprob"):
        compare(served_as(ref, logprobs=logprobs), ref)


def test_a_different_token_fails_unless_near_tied():
    ref = reference()
    tokens = list(ref.tokens)
    tokens[3] = 200 + 3  # PEFT's runner-up, a whole logit below
    logprobs = list(ref.logprobs)
    logprobs[3] = ref.top_logprobs[3][1]
    with pytest.raises(AssertionError, match="token 3 differs"):
        compare(served_as(ref, tokens=tokens, logprobs=logprobs), ref)


def test_a_near_tie_taken_the_other_way_ends_the_comparison_and_is_counted():
    ref = reference({0: NEAR_TIE / 4})
    tokens, logprobs = list(ref.tokens), list(ref.logprobs)
    tokens[0], logprobs[0] = 200, ref.top_logprobs[0][1]
    stats = OracleStats()
    with STATS.paused():
        assert assert_matches(served_as(ref, tokens=tokens, logprobs=logprobs), ref, "made-up") == 0
        stats.num_comparisons, stats.num_tokens, stats.early = STATS.num_comparisons, STATS.num_tokens, STATS.early
    assert (stats.num_comparisons, stats.num_tokens, len(stats.early)) == (1, 1, 1)  # ends at token 0: early
    # the logprob of the token it took is still checked
    logprobs[0] += 2 * LOGPROB_ATOL
    with pytest.raises(AssertionError, match="token 0: logprob"):
        compare(served_as(ref, tokens=tokens, logprobs=logprobs), ref)


def test_a_near_tie_taken_the_same_way_goes_on():
    ref = reference({2: NEAR_TIE / 4})
    assert compare(served_as(ref), ref) is None


def test_top_k_must_hold_the_same_tokens_with_the_same_logprobs():
    ref = reference()
    served = served_as(ref)
    served.top[4][1] = (999, served.top[4][1][1])  # a token PEFT does not rank
    with pytest.raises(AssertionError, match="not in PEFT's top"):
        compare(served, ref)
    served = served_as(ref)
    token, lp = served.top[6][2]
    served.top[6][2] = (token, lp + 2 * LOGPROB_ATOL)
    with pytest.raises(AssertionError, match="top-k logprob"):
        compare(served, ref)


def test_top_k_may_differ_only_at_a_near_tie_on_its_lower_edge():
    ref = reference()
    # PEFT's 5th and 6th entries are 1 apart: serving the 6th instead of the 5th is wrong
    served = served_as(ref)
    served.top[1][-1] = (ref.top_ids[1][TOP_K], ref.top_logprobs[1][TOP_K])
    with pytest.raises(AssertionError, match="missing from the served top-k"):
        compare(served, ref)
    # ... unless they are near-tied
    lps = list(ref.top_logprobs[1])
    lps[TOP_K] = lps[TOP_K - 1] - NEAR_TIE / 4
    tied = OracleOutput(ref.tokens, ref.logprobs, ref.top_ids, [*ref.top_logprobs[:1], lps,
                                                                *ref.top_logprobs[2:]], ref.top2_gaps, False)
    served.top[1][-1] = (tied.top_ids[1][TOP_K], lps[TOP_K])
    assert compare(served, tied) is None


def test_too_few_tokens_or_a_short_answer_fail():
    ref = reference()
    short = OracleOutput(ref.tokens[:3], ref.logprobs[:3], ref.top_ids[:3], ref.top_logprobs[:3],
                         ref.top2_gaps[:3], stopped_at_eos=True)
    with pytest.raises(AssertionError, match="at least 8"):
        compare(served_as(short), short)
    with pytest.raises(AssertionError, match="served stops"):
        compare(served_as(ref, tokens=ref.tokens[:5], logprobs=ref.logprobs[:5]), ref)


def test_the_run_fails_above_the_early_share():
    stats = OracleStats(num_comparisons=20, early=["x"])
    assert not stats.too_many_early()  # 5%
    stats.early.append("y")
    assert stats.too_many_early()
    assert stats.summary().startswith("oracle: 20 comparisons, 0 tokens compared, 2 ended early at a near tie")

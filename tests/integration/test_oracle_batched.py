"""The PEFT oracle's batched path (`PeftOracle.prefetch`) against its one-prompt-at-a-time path (`greedy` on a fresh
oracle): the same tokens, the same EOS stops, logprobs and top-k equal within the comparison's tolerance (held by
`assert_matches` itself, uncounted). The e2e modules prefetch their PEFT outputs through this path, so a padding,
attention-mask or aLoRA-offset mistake in it would show here first, on prompts of unequal lengths, rows that stop at
EOS while others go on, an aLoRA row without its invocation sequence, and shifted activation starts. (Dropping the
mask, or an offset one token off, fails it; wrong positions alone would not: rotary attention sees only relative
positions, so a row shifted by its padding computes the same.)"""

from __future__ import annotations

import pytest

from tests.oracle import STATS, TOP_K, OracleOutput, PeftOracle, Served, assert_matches

QUESTIONS = [  # each adapter below stops at EOS within NEW_TOKENS on some of these and runs on past others
    "Hi",
    "Reply with one word: is water wet?",
    "What is 2+2? Answer with a number only.",
    "Name three rivers of Europe and say which one is the longest.",
]
NEW_TOKENS = 10


def _served(out: OracleOutput) -> Served:
    top = [list(zip(ids[:TOP_K], lps[:TOP_K])) for ids, lps in zip(out.top_ids, out.top_logprobs)]
    return Served(tokens=list(out.tokens), logprobs=list(out.logprobs), top=top)


@pytest.fixture(scope="module")
def items(manifest, tokenizer):
    """(adapter dir or None, input ids, max new tokens, activation shift) on the base model, a LoRA and an aLoRA."""
    lora = next(e for e in manifest if e["kind"] == "lora")
    alora = next(e for e in manifest if e["kind"] == "alora")
    out = []
    for i, q in enumerate(QUESTIONS):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        out.append((None, ids, NEW_TOKENS, 0))
        out.append((lora["path"], ids, NEW_TOKENS, 0))
        invoked = ids + list(alora["invocation_token_ids"])
        out.append((alora["path"], invoked if i else ids, NEW_TOKENS, 0))  # the first without its invocation
        if i == 3:
            out += [(alora["path"], invoked, NEW_TOKENS, shift) for shift in (-1, 1)]
    return out


def test_batched_oracle_outputs_equal_one_at_a_time(model_path, tokenizer, items):
    ignore_eos = False  # rows stop at their own EOS (with True every row runs the same steps, the simpler case)
    batched = PeftOracle(model_path, eos_token_ids={tokenizer.eos_token_id})
    single = PeftOracle(model_path, eos_token_ids={tokenizer.eos_token_id})
    batched.prefetch(items, ignore_eos=ignore_eos, batch_size=3)  # several batches per adapter
    assert len(batched._cache) == len(items)
    stops = 0
    for path, ids, n, shift in items:
        want = single.greedy(path, ids, n, ignore_eos=ignore_eos, activation_shift=shift)
        got = batched._cache[(path, tuple(ids), shift, ignore_eos)]
        assert got.stopped_at_eos == want.stopped_at_eos and len(got.tokens) == len(want.tokens), (path, ids)
        with STATS.paused():
            assert_matches(_served(got), want, f"batched {path} {ids[-6:]} shift {shift}", min_tokens=1)
        stops += want.stopped_at_eos
    # The cases cover what batching could get wrong: rows ending at EOS next to rows that run on.
    assert 0 < stops < len(items), stops


def test_adapters_deleted_past_the_cap_load_again_and_answer_the_same(model_path, tokenizer, manifest, monkeypatch):
    """The oracle keeps at most MAX_LOADED_ADAPTERS adapters in its PEFT model: past the cap the least recently used
    is deleted (and its layers with it), and a prompt on it later loads it again and gets what a fresh oracle gets,
    bit for bit."""
    import tests.oracle as oracle_module

    monkeypatch.setattr(oracle_module, "MAX_LOADED_ADAPTERS", 2)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[1]}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    entries = [e for e in manifest if e["kind"] == "lora"][:3]
    assert len(entries) == 3
    oracle = PeftOracle(model_path, eos_token_ids={tokenizer.eos_token_id})
    first = [oracle.greedy(e["path"], ids, 4, ignore_eos=True) for e in entries]
    assert list(oracle.loaded) == [entries[1]["path"], entries[2]["path"]]  # the first was deleted
    assert set(oracle.peft.peft_config) == set(oracle.loaded.values())
    assert not any(n.split(".")[-1] == "a0" for n, _ in oracle.peft.named_modules())  # the first load's layers
    assert any(n.split(".")[-1] == "a1" for n, _ in oracle.peft.named_modules())
    again = oracle.greedy(entries[0]["path"], ids + [ids[-1]], 4, ignore_eos=True)  # a new prompt: computed again
    assert oracle.num_loads == 4 and list(oracle.loaded)[-1] == entries[0]["path"]
    fresh = PeftOracle(model_path, eos_token_ids={tokenizer.eos_token_id})
    assert again == fresh.greedy(entries[0]["path"], ids + [ids[-1]], 4, ignore_eos=True)
    assert first[0] == fresh.greedy(entries[0]["path"], ids, 4, ignore_eos=True)
    assert first[0] != first[1]  # the adapters differ, so answering with the wrong one would show

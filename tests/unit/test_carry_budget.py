"""The token budget a moved request continues with (sgl_multilora/gateway/carry.py): what its client asked for less
the tokens already out, SGLang's default of 128 when it asked for nothing, and no bound when it set none (a chat
completion without `max_tokens` reaches the worker as `max_new_tokens: null`, which SGLang runs up to the context
length: a continuation capped at 128 would end a long answer early)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sgl_multilora.gateway.carry import CarriedRequest


def continued(params: dict, num_done: int) -> tuple[dict, int | None]:
    carried = CarriedRequest(SimpleNamespace(), {"input_ids": [1, 2, 3], "sampling_params": params}, 0, None, "p")
    carried.prompt_ids, carried.done_ids = [1, 2, 3], [7] * num_done
    carried.migrations = [{"from": 0, "to": 1, "kind": "recompute", "at_token": num_done}]
    body = carried._segment_body()
    assert body["input_ids"] == [1, 2, 3] + [7] * num_done
    return body["sampling_params"], carried._left()


@pytest.mark.parametrize("params, num_done, expected", [
    ({"max_new_tokens": 10, "min_new_tokens": 6}, 4, {"max_new_tokens": 6, "min_new_tokens": 2}),
    ({}, 4, {"max_new_tokens": 124}),
    ({"max_new_tokens": None}, 200, {"max_new_tokens": None}),
])
def test_a_continuation_gets_what_is_left_of_the_budget(params, num_done, expected):
    got, left = continued(params, num_done)
    assert got == expected
    assert left == expected["max_new_tokens"]

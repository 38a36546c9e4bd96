"""Which `/generate` requests the cluster's gateway can move between workers (sgl_multilora/cluster/carry.py): one
prompt, no input logprobs. The moves themselves run against real workers in tests/e2e/test_cluster.py."""

from __future__ import annotations

import pytest

from sgl_multilora.cluster.carry import carriable


@pytest.mark.parametrize("body", [
    {"text": "hello"},
    {"input_ids": [1, 2, 3], "lora_path": "caps"},
    {"text": "hello", "return_logprob": True, "top_logprobs_num": 5},  # output logprobs are joined across moves
    {"text": "hello", "return_logprob": True, "logprob_start_len": -1},
    {"text": "hello", "stream": True, "sampling_params": {"max_new_tokens": 8, "n": 1}},
])
def test_single_prompt_requests_are_carried(body):
    assert carriable(body)


@pytest.mark.parametrize("body", [
    {"text": ["a", "b"]},  # a batch
    {"input_ids": [[1, 2], [3]]},
    {"input_ids": []},
    {"text": "a", "input_ids": [1]},
    {"text": "a", "return_logprob": True, "logprob_start_len": 0},  # input logprobs: a continuation's prompt differs
    {"text": "a", "return_logprob": True, "logprob_start_len": [0]},
    {"text": "a", "sampling_params": {"n": 2}},
    {"text": "a", "rid": ["x"]},
    {"text": "a", "session_params": {"id": "s"}},
    {},
])
def test_other_requests_pass_through(body):
    assert not carriable(body)

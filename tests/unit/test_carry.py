"""Which `/generate` requests the cluster's gateway can move between workers (sgl_multilora/gateway/carry.py): one
prompt, no input logprobs. The moves themselves run against real workers in tests/e2e/test_cluster.py."""

from __future__ import annotations

import pytest

from sgl_multilora.gateway.carry import carriable


@pytest.mark.parametrize("body", [
    {"text": "hello"},
    {"input_ids": [1, 2, 3], "lora_path": "caps"},
    {"text": "hello", "return_logprob": True, "top_logprobs_num": 5},  # output logprobs are joined across moves
    {"text": "hello", "return_logprob": True, "logprob_start_len": -1},
    {"text": "hello", "stream": True, "sampling_params": {"max_new_tokens": 8, "n": 1}},
    # defaults and stateless parameters, as SGLang's OpenAI mapping writes them (None for unset)
    {"text": "hello", "sampling_params": {"regex": None, "json_schema": None, "frequency_penalty": 0.0,
                                          "presence_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": {"5": 1},
                                          "stop": ["x"], "temperature": 0.7, "top_k": 20}},
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
    # state over the whole output: a continuation would start it over
    {"text": "a", "sampling_params": {"json_schema": '{"type": "object"}'}},
    {"text": "a", "sampling_params": {"regex": "[a-z]+"}},
    {"text": "a", "sampling_params": {"ebnf": "root ::= 'x'"}},
    {"text": "a", "sampling_params": {"stop_regex": "\\d+"}},
    {"text": "a", "sampling_params": {"frequency_penalty": 0.5}},
    {"text": "a", "sampling_params": {"presence_penalty": -0.1}},
    {"text": "a", "sampling_params": {"repetition_penalty": 1.1}},
    {"text": "a", "custom_logit_processor": "..."},
    {"text": "a", "sampling_params": "not a dict"},
])
def test_other_requests_pass_through(body):
    assert not carriable(body)

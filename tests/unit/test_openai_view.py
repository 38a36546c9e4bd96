"""OpenAI `/v1/completions` requests the gateway carries (sgl_multilora/gateway/openai_view.py): the native body is
what SGLang's own completion route builds (its request model and `_build_sampling_params` as the oracle), the rest
pass through, and the view writes SGLang's own response objects (its pydantic models as the oracle). A carried
completion moved between live workers: tests/e2e/test_cluster.py."""

from __future__ import annotations

import json

import pytest

from sgl_multilora.gateway.openai_view import CompletionView, ServingSettings, completion_as_native

protocol = pytest.importorskip("sglang.srt.entrypoints.openai.protocol")
serving = pytest.importorskip("sglang.srt.entrypoints.openai.serving_completions")
usage_processor = pytest.importorskip("sglang.srt.entrypoints.openai.usage_processor")

PLAIN = ServingSettings()


@pytest.mark.parametrize("body", [
    {"model": "m", "prompt": "Hello"},
    {"model": "m", "prompt": ["Hello"], "max_tokens": 7, "temperature": 0, "stream": True},
    {"model": "m", "prompt": [1, 2, 3], "stop": ["\n", "."], "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 4,
     "ignore_eos": True, "no_stop_trim": True, "min_tokens": 2, "stop_token_ids": [7], "logit_bias": {"3": -1.0}},
    {"model": "m", "prompt": [[5, 6]], "skip_special_tokens": False, "stream": True,
     "stream_options": {"include_usage": True}, "lora_path": "caps", "rid": "r1", "extra_key": "k",
     "cache_salt": "s", "priority": 2, "user": "u", "best_of": 1, "repetition_penalty": 1.0},
])
def test_carried_body_is_what_sglang_builds(body):
    native = completion_as_native(body, PLAIN)
    assert native is not None
    request = protocol.CompletionRequest.model_validate(body)
    assert native["sampling_params"] == serving.OpenAIServingCompletion._build_sampling_params(None, request)
    prompt = request.prompt[0] if isinstance(request.prompt, list) and isinstance(request.prompt[0], (str, list)) \
        else request.prompt
    assert native.get("text", native.get("input_ids")) == prompt
    assert native["stream"] == request.stream
    for field in ("lora_path", "rid", "extra_key", "cache_salt", "priority"):
        assert native.get(field) == getattr(request, field)


@pytest.mark.parametrize("body", [
    {"model": "m", "prompt": "a", "n": 2},
    {"model": "m", "prompt": "a", "best_of": 2},
    {"model": "m", "prompt": "a", "logprobs": 1},
    {"model": "m", "prompt": "a", "echo": True},
    {"model": "m", "prompt": "a", "suffix": "z"},
    {"model": "m", "prompt": "a", "return_token_ids": True},
    {"model": "m", "prompt": "a", "json_schema": "{}"},
    {"model": "m", "prompt": "a", "response_format": {"type": "json_object"}},
    {"model": "m", "prompt": "a", "frequency_penalty": 0.3},
    {"model": "m", "prompt": "a", "something_new": 1},  # a field this module does not know
    {"model": "m", "prompt": ["a", "b"]},
    {"model": "m", "prompt": ""},
    {"model": "m", "prompt": [1, "a"]},
    {"model": "m", "prompt": "a", "max_tokens": 0},
    {"model": "m", "prompt": "a", "temperature": None},  # not an optional field: the worker's validation answers
    {"model": "m", "prompt": "a", "max_tokens": 3.5},
    {"model": "m", "prompt": "a", "ignore_eos": 1},
    {"model": "m", "prompt": "a", "top_k": True},
    {"model": "m", "prompt": "a", "rid": ["x"]},
    {"model": "m", "prompt": "a", "stream_options": {"include_usage": True, "other": 1}},
    "not an object",
])
def test_other_requests_pass_through(body):
    assert completion_as_native(body, PLAIN) is None


def test_nothing_is_carried_with_a_completion_template():
    assert completion_as_native({"model": "m", "prompt": "a"}, ServingSettings(completion_template="x")) is None


def native_chunk(text: str, n: int, reason: dict | None) -> dict:
    return {"text": text, "output_ids": list(range(n)), "meta_info": {
        "id": "rid-1", "prompt_tokens": 9, "completion_tokens": n, "cached_tokens": 4, "finish_reason": reason,
        "weight_version": "default"}}


@pytest.mark.parametrize("settings", [PLAIN, ServingSettings(default_include_usage=True, enable_cache_report=True)])
@pytest.mark.parametrize("options", [None, {"include_usage": True, "continuous_usage_stats": True}])
def test_view_writes_sglang_objects(settings, options):
    body = {"model": "m", "prompt": "a", "stream": True, **({"stream_options": options} if options else {})}
    request = protocol.CompletionRequest.model_validate(body)
    view = CompletionView(body, settings, incremental=False)
    chunks = [native_chunk("Hel", 1, None), native_chunk("Hello", 2, None),
              native_chunk("Hello, w", 3, {"type": "stop", "matched": "orld"})]
    events = [view.stream_chunk(c) for c in chunks] + [view.stream_end()]
    got = [json.loads(e[6:]) for ev in events for e in ev.split(b"\n\n") if e and e != b"data: [DONE]"]
    assert events[-1].endswith(b"data: [DONE]\n\n")
    include_usage = bool(options) or settings.default_include_usage
    assert len(got) == 3 + include_usage
    sent = ""
    cache = settings.enable_cache_report
    for chunk, native in zip(got, chunks):
        meta = native["meta_info"]
        reason = meta["finish_reason"]
        usage = usage_processor.UsageProcessor.calculate_token_usage(
            prompt_tokens=9, completion_tokens=meta["completion_tokens"], reasoning_tokens=0)
        expected = protocol.CompletionStreamResponse(
            id="rid-1", created=chunk["created"], model="m", choices=[protocol.CompletionResponseStreamChoice(
                index=0, text=native["text"][len(sent):], finish_reason=reason["type"] if reason else None,
                matched_stop=reason["matched"] if reason else None)],
            usage=usage if options else None)
        assert chunk == json.loads(expected.model_dump_json())
        sent = native["text"]
    if include_usage:
        usage = usage_processor.UsageProcessor.calculate_streaming_usage(
            {0: 9}, {0: 0}, {0: 3}, cached_tokens={0: 4}, n_choices=1, enable_cache_report=cache)
        expected = protocol.CompletionStreamResponse(id="rid-1", created=got[-1]["created"], choices=[], model="m",
                                                     usage=usage)
        assert got[-1] == json.loads(expected.model_dump_json(exclude_none=True))
    final = view.response(chunks[-1])
    usage = usage_processor.UsageProcessor.calculate_response_usage([chunks[-1]], n_choices=1,
                                                                    enable_cache_report=cache)
    expected = protocol.CompletionResponse(
        id="rid-1", model="m", created=final["created"], usage=usage, metadata={"weight_version": "default"},
        choices=[protocol.CompletionResponseChoice(index=0, text="Hello, w", finish_reason="stop",
                                                   matched_stop="orld")])
    assert final == json.loads(expected.model_dump_json(by_alias=True))
    assert request.model == "m"


def test_incremental_workers_send_deltas_as_they_are():
    view = CompletionView({"model": "m", "prompt": "a"}, PLAIN, incremental=True)
    texts = [json.loads(view.stream_chunk(native_chunk(t, 1, None))[6:])["choices"][0]["text"] for t in ("ab", "c")]
    assert texts == ["ab", "c"]
    # errors as SGLang's OpenAI routes write them (ErrorResponse)
    worker = {"error": {"message": "too long", "type": "invalid_request_error", "code": 400, "retryable": False}}
    expected = protocol.ErrorResponse(message="too long", type="BadRequestError", code=400).model_dump()
    assert view.response(worker) == expected
    assert json.loads(view.stream_chunk(worker)[6:]) == {"error": expected}
    ours = {"error": {"message": "no worker", "type": "server_error", "code": 503, "retryable": True}}
    assert view.response(ours) == {"object": "error", "message": "no worker", "type": "server_error", "param": None,
                                   "code": 503}


@pytest.mark.parametrize("settings", [PLAIN, ServingSettings(default_include_usage=True, enable_cache_report=True)])
@pytest.mark.parametrize("options", [None, {"include_usage": True, "continuous_usage_stats": True}])
def test_chat_view_writes_what_serving_chat_writes(settings, options):
    """The role chunk, one chunk per non-empty delta, the finish chunk, the usage chunk: SGLang's own chunk builder
    and models as the oracle (serving_chat's plain path: no reasoning parser, no tools, no logprobs)."""
    from sgl_multilora.gateway.openai_view import ChatView

    sse_utils = pytest.importorskip("sglang.srt.entrypoints.openai.sse_utils")
    body = {"model": "m:caps", "messages": [], "stream": True, **({"stream_options": options} if options else {})}
    view = ChatView(body, settings, incremental=False)
    chunks = [native_chunk("Hel", 1, None), native_chunk("Hel", 2, None), native_chunk("Hello, w", 3, None),
              native_chunk("Hello, w", 4, {"type": "stop", "matched": 2})]
    events = b"".join(view.stream_chunk(c) for c in chunks) + view.stream_end()
    got = [json.loads(e[6:]) for e in events.split(b"\n\n") if e and e != b"data: [DONE]"]
    assert events.endswith(b"data: [DONE]\n\n")
    cache = settings.enable_cache_report

    def usage_at(native):
        meta = native["meta_info"]
        details = protocol.PromptTokensDetails(cached_tokens=4) if cache else None
        return usage_processor.UsageProcessor.calculate_token_usage(
            prompt_tokens=9, reasoning_tokens=0, completion_tokens=meta["completion_tokens"],
            cached_tokens=details).model_dump()

    continuous = bool(options)
    expected = [sse_utils.build_sse_content(chunk_id="rid-1", created=view.created, model="m:caps", index=0,
                                            role="assistant", content="", reasoning_content=None),
                sse_utils.build_sse_content(chunk_id="rid-1", created=view.created, model="m:caps", index=0,
                                            content="Hel", usage=usage_at(chunks[0]) if continuous else None),
                sse_utils.build_sse_content(chunk_id="rid-1", created=view.created, model="m:caps", index=0,
                                            content="lo, w", usage=usage_at(chunks[2]) if continuous else None),
                sse_utils.build_sse_content(chunk_id="rid-1", created=view.created, model="m:caps", index=0,
                                            finish_reason="stop", matched_stop=2)]
    include_usage = bool(options) or settings.default_include_usage
    if include_usage:
        usage = usage_processor.UsageProcessor.calculate_streaming_usage(
            {0: 9}, {0: 0}, {0: 4}, cached_tokens={0: 4}, n_choices=1, enable_cache_report=cache)
        expected.append("data: " + protocol.ChatCompletionStreamResponse(
            id="rid-1", created=view.created, choices=[], model="m:caps", usage=usage).model_dump_json() + "\n\n")
    assert got == [json.loads(e[6:]) for e in expected]
    final = view.response(chunks[-1])
    usage = usage_processor.UsageProcessor.calculate_response_usage([chunks[-1]], n_choices=1,
                                                                    enable_cache_report=cache)
    expected = protocol.ChatCompletionResponse(
        id="rid-1", created=final["created"], model="m:caps", usage=usage, metadata={"weight_version": "default"},
        choices=[protocol.ChatCompletionResponseChoice(
            index=0, message=protocol.ChatMessage(role="assistant", content="Hello, w"), finish_reason="stop",
            matched_stop=2)])
    assert final == json.loads(expected.model_dump_json(by_alias=True))
    # deltas as they come from an incremental worker; an error as SGLang's OpenAI routes write it
    view = ChatView({"model": "m", "messages": []}, PLAIN, incremental=True)
    texts = [json.loads(e[6:])["choices"][0]["delta"].get("content")
             for t in ("ab", "c") for e in view.stream_chunk(native_chunk(t, 1, None)).split(b"\n\n") if e]
    assert texts == ["", "ab", "c"]
    worker = {"error": {"message": "too long", "type": "invalid_request_error", "code": 400, "retryable": False}}
    assert view.response(worker) == protocol.ErrorResponse(message="too long", type="BadRequestError",
                                                           code=400).model_dump()

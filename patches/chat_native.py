"""`POST /multilora/chat/native`: an OpenAI chat completion as the native `/generate` body this server's own
`/v1/chat/completions` would run for it, so that the cluster's gateway can carry it, and move it mid-generation,
like any native request (sgl_multilora/gateway/openai_view.py writes the client's chat objects).

Only the server can say what its chat route runs: the prompt is its chat template over the messages (tokenized by
its tokenizer, with its template's stop strings and its model's default sampling parameters), so the route runs
SGLang's own `OpenAIServingChat` validation and conversion and answers the `GenerateReqInput` it built, as JSON:
`{"native": {...}}`. It answers `{"native": null, "reason": ...}` when the gateway must pass the request to the chat
route instead, because the gateway's view could not write the answer the chat route would, or a move could not
continue it exactly: more than one choice, logprobs, tools or a reasoning parser at work, a response template, a
model-specific encoding, multimodal content, token ids or other extras asked back, constrained decoding or
penalties (carry.carriable), any field of the built request outside the plain ones below. An invalid request gets
`{"native": null}` too: the chat route then answers it with its own error. Read-only: nothing is queued or cached.
"""

# (no `from __future__ import annotations`: FastAPI reads the route's `Request` annotation at run time)

import dataclasses
import logging

logger = logging.getLogger(__name__)

ROUTE = "/multilora/chat/native"
PLAIN_FIELDS = {"text", "input_ids", "sampling_params", "stream", "lora_path", "rid", "extra_key", "cache_salt",
                "priority", "logprob_start_len", "return_text_in_logprobs", "return_logprob", "top_logprobs_num"}
"""Fields of the built `GenerateReqInput` the native body may hold at any value (the logprob ones are off: n=1
requests without logprobs only, checked before conversion)."""
REQUEST_EXTRAS = ("return_hidden_states", "return_routed_experts", "return_cached_tokens_details",
                  "return_spec_tokens_details", "return_prompt_token_ids", "return_token_ids", "return_meta_info",
                  "return_input_ids_in_sglext", "return_output_ids_in_sglext", "return_sampling_mask",
                  "return_flat_raw_output_top_logprobs")
"""Chat request fields asking for something back that the gateway's view does not write: any of them set, and the
request is not carried."""


def chat_blocker(chat, request) -> "str | None":
    """Why `request` (a validated `ChatCompletionRequest`) cannot be carried, before conversion; None if it can."""
    if request.n != 1:
        return "n > 1"
    if request.logprobs or request.top_logprobs:
        return "logprobs"
    if chat.reasoning_parser and request.separate_reasoning:
        return "reasoning parser"
    if chat._tool_call_parsing_active(request) or request.tools:
        return "tools"
    if chat._encoding_output() is not None:
        return "model-specific chat encoding"
    if chat._should_return_input_ids(request) or chat._should_return_output_ids(request):
        return "token ids asked back"
    for name in REQUEST_EXTRAS:
        if getattr(request, name, None):
            return name
    return None


def native_body(adapted, request) -> "tuple[dict | None, str | None]":
    """(the native body of a built `GenerateReqInput`, None) or (None, why it cannot be carried)."""
    from sgl_multilora.gateway.carry import carriable

    if request._response_parser_grammar_start is not None or request._response_parser_tool_grammar:
        return None, "response template"
    body = {}
    for f in dataclasses.fields(adapted):
        value = getattr(adapted, f.name)
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
        if value is None or value is default or (default is not dataclasses.MISSING and value == default) or (
                default is None and value in (False, 0, "", [], {})):
            continue  # unset (the chat route passes False or 0 where the field defaults to None)
        if f.name not in PLAIN_FIELDS:
            return None, f"built request field {f.name}"
        body[f.name] = value
    body.setdefault("stream", False)
    if not carriable(body):
        return None, "not continuable after a move (constrained decoding, penalties, ...)"
    return body, None


def add_routes(*args, **kwargs):
    """BEFORE hook on `http_server.launch_server` (runs in the HTTP process only). Idempotent."""
    from fastapi import Request
    from pydantic import ValidationError
    from sglang.srt.entrypoints import http_server
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    if any(getattr(route, "path", None) == ROUTE for route in http_server.app.routes):
        return

    @http_server.app.post(ROUTE)
    async def multilora_chat_native(raw_request: Request):
        chat = raw_request.app.state.openai_serving_chat
        try:
            request = ChatCompletionRequest.model_validate(await raw_request.json())
        except (ValueError, ValidationError) as e:
            return {"native": None, "reason": f"invalid request: {e}"}
        reason = chat_blocker(chat, request)
        if reason is not None:
            return {"native": None, "reason": reason}
        try:
            if chat._validate_request(request):
                return {"native": None, "reason": "invalid request"}
            adapted, request = chat._convert_to_internal_request(request, None)
            body, reason = native_body(adapted, request)
        except Exception as e:  # the chat route answers it with its own error
            return {"native": None, "reason": f"not converted: {type(e).__name__}: {e}"}
        return {"native": body, "reason": reason}

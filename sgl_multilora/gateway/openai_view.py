"""OpenAI `/v1/completions` requests carried as native `/generate` ones, so that they can move between workers too.

Lives here: `completion_as_native` (the OpenAI body as the native body its worker's OpenAI route would have run)
and `CompletionView` (a carried request's native chunks written as SGLang's `serving_completions` writes its own
answers: the same objects and fields, a text delta per chunk, the usage chunk, `[DONE]`). Not here: carrying and
moving (carry.py), routing (gateway.py). No SGLang import: the gateway stays a light process; tests check both
functions against SGLang's own request model, sampling mapping and a worker's own answers.

Carried only when a move can continue the request exactly and this view can write everything the client asked
for: one prompt, `n` = 1, no logprobs, no `echo` or `suffix`, no token ids, hidden states or routed experts asked
back, nothing whose state spans the output (carry.carriable: constrained decoding, penalties) and no completion
template on the workers (`--completion-template` rewrites the prompt inside their OpenAI route). Any other
request, or a field this module does not know, goes to smg as before: served the same, never moved.

Chat completions: their prompt is the worker's chat template over the messages, with its tokenizer, stop strings
and model defaults, which only a worker can reproduce token for token; so a worker builds the native body itself
(`POST /multilora/chat/native`, patches/chat_native.py, running SGLang's own chat conversion) and says when a chat
request cannot be carried (tools, reasoning parsers, logprobs, n > 1, ...). `ChatView` writes what the worker's
`serving_chat` writes for a plain answer: the role chunk, content deltas, the finish chunk, the usage chunk.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from sgl_multilora.gateway.carry import carriable, error_status

SAMPLING_FIELDS = {
    # CompletionRequest field -> (native sampling parameter, SGLang's default); serving_completions'
    # _build_sampling_params passes each one, set or not
    "temperature": ("temperature", 1.0), "max_tokens": ("max_new_tokens", 16), "min_tokens": ("min_new_tokens", 0),
    "stop": ("stop", None), "stop_token_ids": ("stop_token_ids", None), "top_p": ("top_p", 1.0),
    "top_k": ("top_k", -1), "min_p": ("min_p", 0.0), "presence_penalty": ("presence_penalty", 0.0),
    "frequency_penalty": ("frequency_penalty", 0.0), "repetition_penalty": ("repetition_penalty", 1.0),
    "n": ("n", 1), "no_stop_trim": ("no_stop_trim", False), "ignore_eos": ("ignore_eos", False),
    "skip_special_tokens": ("skip_special_tokens", True), "logit_bias": ("logit_bias", None),
    "seed": ("sampling_seed", None),
}
UNSET_PARAMS = ("stop_regex", "regex", "json_schema", "ebnf", "custom_params", "watermark")
"""Native parameters `_build_sampling_params` also passes, None for every carried request."""
PASSED_FIELDS = ("lora_path", "rid", "extra_key", "cache_salt", "priority")
"""Request fields the native body takes as they are."""
FREE_FIELDS = ("prompt", "model", "stream", "stream_options", "user")
"""Fields any carried request may hold (the prompt and the stream's options are read below)."""
NEUTRAL_FIELDS = {"best_of": (None, 1), "echo": (False,), "logprobs": (None,), "suffix": (None,),
                  "return_hidden_states": (False,), "return_routed_experts": (False,),
                  "routed_experts_start_len": (0,), "return_cached_tokens_details": (False,),
                  "return_spec_tokens_details": (False,), "return_token_ids": (False,), "regex": (None,),
                  "json_schema": (None,), "ebnf": (None,), "stop_regex": (None,), "response_format": (None,),
                  "custom_params": (None,), "custom_logit_processor": (None,), "session_id": (None,),
                  "session_params": (None,), "watermark": (None,), "custom_labels": (None,)}
"""Fields a carried request may hold only at these values: the others need what this view does not write or what
a move cannot continue."""


@dataclass(frozen=True)
class ServingSettings:
    """What the workers' OpenAI route reads from their server arguments (`/get_server_info`)."""

    completion_template: str | None = None
    default_include_usage: bool = False
    enable_cache_report: bool = False

    @classmethod
    def from_server_info(cls, info: dict) -> ServingSettings:
        return cls(info.get("completion_template") or None,
                   bool(info.get("stream_response_default_include_usage")),
                   bool(info.get("enable_cache_report")))


def completion_as_native(body: dict, settings: ServingSettings) -> dict | None:
    """The native `/generate` body a worker's `/v1/completions` would run for `body` (already rewritten by the
    gateway: `model` the served one, an adapter in `lora_path`), or None when the request is not carried."""
    if settings.completion_template is not None or not isinstance(body, dict):
        return None
    known = set(SAMPLING_FIELDS) | set(PASSED_FIELDS) | set(NEUTRAL_FIELDS) | set(FREE_FIELDS)
    if set(body) - known or any(body[k] not in NEUTRAL_FIELDS[k] for k in body.keys() & NEUTRAL_FIELDS.keys()):
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        native: dict = {"text": prompt}
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        native = {"input_ids": prompt}
    else:
        return None
    if any(name in body and not _typed(body[name], default) for name, (_, default) in SAMPLING_FIELDS.items()):
        return None  # the worker's validation answers it
    params = {native_name: body.get(name, default) for name, (native_name, default) in SAMPLING_FIELDS.items()}
    params.update(dict.fromkeys(UNSET_PARAMS))
    if params["max_new_tokens"] <= 0:
        return None  # the worker's validation answers it
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict)
                                    and set(options) <= {"include_usage", "continuous_usage_stats"}):
        return None
    native["sampling_params"] = params
    native["stream"] = bool(body.get("stream", False))
    passed = {k: body[k] for k in PASSED_FIELDS if body.get(k) is not None}
    if any(not isinstance(v, str) for k, v in passed.items() if k != "priority"):
        return None  # a list: a batch's fields
    native.update(passed)
    return native if carriable(native) else None


def openai_error(error) -> dict:
    """A native error object (`{"message", "type", "code"}` of a worker's stream, or the gateway's own) as SGLang's
    OpenAI routes write one (`ErrorResponse`): a worker's invalid request is a BadRequestError."""
    error = error if isinstance(error, dict) else {"message": str(error)}
    code = error_status(error)
    kind = error.get("type")
    if kind in (None, "invalid_request_error") and code < 500:
        kind = "BadRequestError"
    kind = kind or "InternalServerError"
    return {"object": "error", "message": str(error.get("message", "")), "type": kind, "param": None, "code": code}


def _typed(value, default) -> bool:
    """`value` has the type SGLang's request model gives the field whose default is `default` (numbers as numbers,
    flags as bools, None only where the default is None), so that what is carried is what the worker accepts."""
    if default is None:
        return True  # an optional field: its own checks stay with the worker (a bad value fails the native body)
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class CompletionView:
    """Native chunks (cumulative `text`, or deltas with `--incremental-streaming-output`) in, OpenAI completion
    chunks and the final object out, as `serving_completions` writes them for one choice."""

    def __init__(self, body: dict, settings: ServingSettings, incremental: bool) -> None:
        self.model = str(body.get("model") or "default")
        self.settings, self.incremental = settings, incremental
        self.include_usage, self.continuous_usage = _stream_options(body, settings)
        self.created = int(time.time())
        self.sent = 0  # characters of the cumulative text already sent
        self.last_meta: dict = {}

    def stream_chunk(self, out: dict) -> bytes:
        """One SSE event for a native chunk (an error object as OpenAI's error event)."""
        if "error" in out:
            return b"data: " + json.dumps({"error": openai_error(out["error"])}).encode() + b"\n\n"
        meta = out.get("meta_info") or {}
        self.last_meta = meta
        text = out.get("text") or ""
        if self.incremental:
            delta = text
        else:
            delta, self.sent = text[self.sent:], len(text)
        reason = meta.get("finish_reason") or None
        chunk = {"id": meta.get("id"), "object": "text_completion", "created": self.created, "model": self.model,
                 "choices": [{"index": 0, "text": delta, "logprobs": None,
                              **finish_fields(reason)}],
                 "usage": self._usage(meta, cached=False, exclude_none=False) if self.continuous_usage else None}
        return b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"

    def stream_end(self) -> bytes:
        """The usage chunk (when asked for) and `[DONE]`."""
        tail = b""
        if self.include_usage:
            usage = {"id": self.last_meta.get("id"), "object": "text_completion", "created": self.created,
                     "model": self.model, "choices": [],
                     "usage": self._usage(self.last_meta, cached=self.settings.enable_cache_report, exclude_none=True)}
            tail = b"data: " + json.dumps(usage).encode() + b"\n\n"
        return tail + b"data: [DONE]\n\n"

    def response(self, out: dict) -> dict:
        """The non-streaming answer for the final native object (an error object as OpenAI's error)."""
        if "error" in out:
            return openai_error(out["error"])
        meta = out.get("meta_info") or {}
        reason = meta.get("finish_reason") or None
        return {"id": meta.get("id"), "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": out.get("text") or "", "logprobs": None,
                             **finish_fields(reason)}],
                "usage": self._usage(meta, cached=self.settings.enable_cache_report, exclude_none=False),
                "metadata": metadata_of(meta)}

    def _usage(self, meta: dict, cached: bool, exclude_none: bool) -> dict:
        return usage_of(meta, cached, exclude_none)


def usage_of(meta: dict, cached: bool, exclude_none: bool) -> dict:
    """UsageProcessor's figures for one choice, as UsageInfo dumps them (`cached`: with the cached tokens, as the
    final usage reports them under `--enable-cache-report`)."""
    prompt, completion = int(meta.get("prompt_tokens", 0)), int(meta.get("completion_tokens", 0))
    reasoning = int(meta.get("reasoning_tokens", 0) or 0)
    details = None
    if cached:
        details = {"cached_tokens": int(meta.get("cached_tokens", 0))}  # its unset media counts are not written
    usage = {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
             "prompt_tokens_details": details, "reasoning_tokens": reasoning,
             "completion_tokens_details": {"reasoning_tokens": reasoning} if reasoning else None}
    return {k: v for k, v in usage.items() if v is not None} if exclude_none else usage


def finish_fields(reason: dict | None) -> dict:
    """A choice's `finish_reason` and `matched_stop` from a native finish reason (None while it runs)."""
    return {"finish_reason": reason["type"] if reason else None,
            "matched_stop": reason.get("matched") if reason else None}


def metadata_of(meta: dict) -> dict:
    """A final answer's `metadata`, as `build_endpoint_weight_version_metadata` writes it."""
    return {"weight_version": meta.get("weight_version"),
            **({"weight_versions": meta["weight_versions"]} if "weight_versions" in meta else {})}


def _stream_options(body: dict, settings: ServingSettings) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) as SGLang's `should_include_usage` reads the request."""
    options = body.get("stream_options") or None
    if options:
        return bool(options.get("include_usage")) or settings.default_include_usage, \
            bool(options.get("continuous_usage_stats"))
    return settings.default_include_usage, False


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class ChatView:
    """Native chunks in, OpenAI chat completion chunks and the final object out, as `serving_chat` writes them for
    one plain choice (no reasoning parser, no tools, no logprobs: the worker carries nothing else): a first chunk
    with the assistant role and empty content, one chunk per non-empty text delta, the finish chunk after the last
    one, then the usage chunk when asked for and `[DONE]`. A chunk's delta always holds `reasoning_content` (null),
    as SGLang's msgspec chunk does."""

    def __init__(self, body: dict, settings: ServingSettings, incremental: bool) -> None:
        self.model = str(body.get("model") or "default")
        self.settings, self.incremental = settings, incremental
        self.include_usage, self.continuous_usage = _stream_options(body, settings)
        self.created = int(time.time())
        self.sent = 0
        self.started = False
        self.finish: dict | None = None
        self.last_meta: dict = {}

    def _chunk(self, delta: dict, meta: dict, finish: dict | None = None, usage: dict | None = None) -> bytes:
        chunk = {"id": meta.get("id"), "object": "chat.completion.chunk", "created": self.created,
                 "model": self.model,
                 "choices": [{"index": 0, "delta": {"reasoning_content": None, **delta}, "logprobs": None,
                              **finish_fields(finish)}]}
        if usage is not None:
            chunk["usage"] = usage
        return _sse(chunk)

    def stream_chunk(self, out: dict) -> bytes:
        if "error" in out:
            return b"data: " + json.dumps({"error": openai_error(out["error"])}).encode() + b"\n\n"
        meta = out.get("meta_info") or {}
        self.last_meta = meta
        events = b""
        if not self.started:
            self.started = True
            events += self._chunk({"role": "assistant", "content": ""}, meta)
        text = out.get("text") or ""
        if self.incremental:
            delta = text
        else:
            delta, self.sent = text[self.sent:], len(text)
        if delta:
            usage = usage_of(meta, self.settings.enable_cache_report, False) if self.continuous_usage else None
            events += self._chunk({"content": delta}, meta, usage=usage)
        if meta.get("finish_reason"):
            self.finish = meta["finish_reason"]
        return events

    def stream_end(self) -> bytes:
        tail = b""
        if self.finish is not None:
            tail += self._chunk({}, self.last_meta, finish=self.finish)
        if self.include_usage:
            tail += _sse({"id": self.last_meta.get("id"), "object": "chat.completion.chunk", "created": self.created,
                          "model": self.model, "choices": [],
                          "usage": usage_of(self.last_meta, self.settings.enable_cache_report, False)})
        return tail + b"data: [DONE]\n\n"

    def response(self, out: dict) -> dict:
        if "error" in out:
            return openai_error(out["error"])
        meta = out.get("meta_info") or {}
        reason = meta.get("finish_reason") or None
        return {"id": meta.get("id"), "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": out.get("text") or "",
                                                     "reasoning_content": None},
                             "logprobs": None, **finish_fields(reason)}],
                "usage": usage_of(meta, self.settings.enable_cache_report, False),
                "metadata": metadata_of(meta)}

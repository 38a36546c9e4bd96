"""Request ingress hardening: no request reaches another adapter's or tenant's KV, and no request crashes the server.

Stock SGLang 0.5.23 trusts three request fields it should not:
- `lora_id`, an internal field, is accepted from clients: an id that is not loaded reaches the scheduler and takes
  every server process down; a loaded adapter's id (computable for `--lora-paths` adapters: uuid5 of name and path)
  selects that adapter's weights and cache without naming it.
- the prefix-cache namespace is the string `extra_key + lora_id`, so a base request whose `extra_key` equals an
  adapter's id (or ends with the right characters) shares that adapter's cached KV.

What this module does (unless `--multilora-stock-baseline ingress`), whichever `--radix-cache-backend` runs:
- tokenizer process: an empty prompt, a token id outside the vocabulary or `top_logprobs_num` above the vocabulary
  size gets HTTP 400 (each crashes stock SGLang).
- tokenizer process: a `lora_path` list whose length is not the batch's, or with entries that are not names, gets
  HTTP 400 (stock answers 500).
- tokenizer process: a request that carries `lora_id` gets HTTP 400. The server resolves adapters itself, from
  `lora_path` (or the OpenAI `model="base:adapter"` form); a silently ignored `lora_id` would hide a client bug and
  answer with the base model. Requests without `lora_id` are untouched.
- scheduler process: every `Req`'s `extra_key` becomes an unambiguous encoding of (the client's extra_key, the
  content identity of its adapter): `mlora1:` + the JSON list of both. The client's string is a JSON string inside it,
  so no choice of `extra_key`, `cache_salt` or adapter reaches another namespace, and changed weights reloaded under
  an old name get a new identity, hence an empty cache. `--radix-cache-backend multilora` decodes it back into its
  structured key (`decode_extra_key`).
- scheduler process: a request whose adapter is not loaded there (a race with unload, or any path that skipped the
  tokenizer's checks) is finished with HTTP 400 naming the adapter before it can join a batch.
"""

from __future__ import annotations

import functools
import inspect
import json
from http import HTTPStatus

from sgl_multilora.patches import flags
from sgl_multilora.patches.state import process_state

PREFIX = "mlora1:"

def encode_extra_key(client_extra_key: str | None, adapter_identity: str | None) -> str | None:
    """The cache namespace string of a request; None only for a base request without a client extra_key."""
    if client_extra_key is None and adapter_identity is None:
        return None
    return PREFIX + json.dumps([client_extra_key, adapter_identity], separators=(",", ":"))


def decode_extra_key(extra_key: str | None) -> tuple[str | None, str | None]:
    """(client extra_key, adapter identity) of a string made by `encode_extra_key`.

    Anything SGLang appends after the encoding (elastic-EP namespacing adds `|...`) stays with the client part, so it
    still separates namespaces. A string without the prefix (a path that built no `Req`) is a client extra_key.
    """
    if extra_key is None or not extra_key.startswith(PREFIX):
        return extra_key, None
    (client, identity), end = json.JSONDecoder().raw_decode(extra_key, len(PREFIX))
    rest = extra_key[end:]
    if rest:
        client = json.dumps([client, rest])
    return client, identity


def _strict() -> bool:
    return flags.current().ingress == "strict"


def adapter_key(lora_id: str) -> str:
    """The namespace component of `lora_id`: its content identity, or the id itself (tagged) while unknown here."""
    identity = process_state().adapters.identity(lora_id)
    return identity if identity is not None else f"lora_id:{lora_id}"


# ---- tokenizer process --------------------------------------------------------------------------------------------


def _has_client_lora_id(obj) -> bool:
    lora_id = getattr(obj, "lora_id", None)
    if isinstance(lora_id, list):
        return any(x is not None for x in lora_id)
    return lora_id is not None


def normalize_batch_and_arguments(result, self, *args, **kwargs):
    """AFTER hook on `GenerateReqInput.normalize_batch_and_arguments()`: HTTP 400 for a malformed `lora_path` before
    the tokenizer manager indexes it per prompt."""
    if _strict():
        check_lora_path_shape(self)


def check_lora_path_shape(obj) -> None:
    """`lora_path` must be one adapter name (or null) for a single request and, for a batch, a name or a list with one
    name (or null) per prompt. Stock 0.5.23 normalises a generate batch's list without checking its length and answers
    HTTP 500 when a prompt has no entry; unhashable entries fail the same way."""
    lora_path = getattr(obj, "lora_path", None)
    if lora_path is None or isinstance(lora_path, str):
        return
    if not isinstance(lora_path, list):
        raise ValueError(f"lora_path must be an adapter name or a list of them, got {type(lora_path).__name__}")
    bad = next((x for x in lora_path if x is not None and not isinstance(x, str)), None)
    if bad is not None:
        raise ValueError(f"lora_path entries must be adapter names or null, got {bad!r}")
    if getattr(obj, "is_single", True):
        raise ValueError("lora_path must be a single adapter name for a single prompt, got a list")
    # normalize_batch_and_arguments() has already repeated the list once per parallel sample
    prompts = obj.batch_size * getattr(obj, "parallel_sample_num", 1)
    if len(lora_path) != prompts:
        given = len(lora_path) // max(1, getattr(obj, "parallel_sample_num", 1))
        raise ValueError(f"lora_path has {given} entries for a batch of {obj.batch_size} prompts")


async def validate_and_resolve_lora(original, self, obj, *args, **kwargs):
    """AROUND hook on `TokenizerManager._validate_and_resolve_lora(obj)`, which fills `obj.lora_id` from the
    registry: anything already there came from the client."""
    if _strict() and _has_client_lora_id(obj):
        raise ValueError(
            "'lora_id' is assigned by the server and cannot be set in a request; name the adapter with "
            "'lora_path' (or model='<base>:<adapter>' in the OpenAI API)"
        )
    return await original(self, obj, *args, **kwargs)


def validate_one_request(result, self, obj, input_ids, *args, **kwargs):
    """AFTER hook on `TokenizerManager._validate_one_request(obj, input_ids)`: HTTP 400 for an empty prompt, a prompt
    token id outside the model's vocabulary, or more top logprobs than the vocabulary has (stock SGLang runs each
    into the model, and the error there stops every server process)."""
    if not _strict() or input_ids is None or getattr(obj, "input_embeds", None) is not None:
        return result
    if len(input_ids) == 0:  # e.g. text "" with a tokenizer that adds no BOS: stock SGLang crashes in the model
        raise ValueError("the prompt is empty: it has no tokens")
    vocab_size = self.model_config.vocab_size
    bad = next((t for t in input_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"input_ids contains the token id {bad}, outside the vocabulary [0, {vocab_size})")
    top = getattr(obj, "top_logprobs_num", None)
    if getattr(obj, "return_logprob", False) and isinstance(top, int) and not 0 <= top <= vocab_size:
        raise ValueError(f"top_logprobs_num must be in [0, {vocab_size}] (the vocabulary size), got {top}")
    return result


# ---- scheduler process --------------------------------------------------------------------------------------------


def req_init(original, self, *args, **kwargs):
    """AROUND hook on `Req.__init__`: the cache namespace is the unambiguous encoding of (the client's extra_key,
    the adapter's identity), taken from the constructor's arguments, not SGLang's `extra_key + lora_id` string."""
    original(self, *args, **kwargs)
    if not _strict():
        return
    bound = _req_signature().bind(self, *args, **kwargs).arguments
    client_extra_key = bound.get("extra_key") or None
    lora_id = bound.get("lora_id")
    self.extra_key = encode_extra_key(client_extra_key, adapter_key(lora_id) if lora_id is not None else None)


@functools.cache
def _req_signature() -> inspect.Signature:
    from sglang.srt.managers.schedule_batch import Req

    return inspect.signature(inspect.unwrap(Req.__init__))


def _loaded_lora_ids(scheduler) -> set[str] | None:
    """The LoRA ids this scheduler's LoRA manager holds, or None when LoRA is off."""
    model_runner = getattr(getattr(scheduler, "tp_worker", None), "model_runner", None)
    manager = getattr(model_runner, "lora_manager", None)
    if manager is None:
        return None
    return set(manager.lora_refs)


def add_request_to_queue(original, self, req, *args, **kwargs):
    """AROUND hook on `Scheduler._add_request_to_queue(req)`: an unloaded adapter ends the request, not the server."""
    lora_id = getattr(req, "lora_id", None)
    pending = req.finished_reason is None and getattr(req, "to_finish", None) is None
    if _strict() and lora_id is not None and pending:
        loaded = _loaded_lora_ids(self)
        if loaded is None or lora_id not in loaded:
            name = getattr(req, "lora_name", None) or lora_id
            reason = "LoRA is not enabled on this server" if loaded is None else "it is not loaded"
            req.set_finish_with_abort(
                f"LoRA adapter {name!r} cannot serve this request: {reason}", status_code=HTTPStatus.BAD_REQUEST
            )
            req.lora_id = None  # the aborted request's one-token step runs on the base model
    return original(self, req, *args, **kwargs)

"""Request ingress for activated LoRA: a request to an aLoRA must contain the adapter's invocation sequence.

Without it the adapter would never activate and the request would silently get the base model's answer; instead it
gets HTTP 400 naming the adapter and the missing sequence. Runs in the HTTP (tokenizer) process.
"""

from __future__ import annotations

import os

from sgl_multilora.adapters import AdapterError, find_invocation_start, read_config

_invocations: dict[tuple[str, float], tuple[int, ...] | None] = {}  # (config path, mtime) -> invocation tokens


def invocation_tokens(adapter_path: str) -> tuple[int, ...] | None:
    """The adapter's `alora_invocation_tokens`, or None for a standard LoRA (cached per config file version)."""
    config_path = os.path.join(adapter_path, "adapter_config.json")
    try:
        key = (config_path, os.path.getmtime(config_path))
    except OSError:
        return None
    if key not in _invocations:
        try:
            tokens = read_config(adapter_path).get("alora_invocation_tokens")
        except AdapterError:
            tokens = None
        _invocations[key] = tuple(tokens) if tokens else None
    return _invocations[key]


def validate_one_request(result, self, obj, input_ids, *args, **kwargs):
    """AFTER hook on `TokenizerManager._validate_one_request(obj, input_ids)`: raises ValueError (HTTP 400)."""
    name = getattr(obj, "lora_path", None)
    if not isinstance(name, str) or input_ids is None:
        return result
    ref = getattr(self, "lora_ref_cache", {}).get(name)
    if ref is None:
        return result
    invocation = invocation_tokens(ref.lora_path)
    if invocation is not None and find_invocation_start(list(input_ids), invocation) is None:
        text = self.tokenizer.decode(list(invocation)) if getattr(self, "tokenizer", None) is not None else ""
        raise ValueError(
            f"aLoRA adapter '{name}' activates at its invocation sequence {list(invocation)} ({text!r}), "
            "which does not occur in the prompt; append it where the adapter should start to apply"
        )
    return result

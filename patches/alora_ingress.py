"""Request ingress for activated LoRA: a request to an aLoRA must contain the adapter's invocation sequence.

Without it the adapter would never activate and the request would silently get the base model's answer; instead it
gets HTTP 400 naming the adapter and the missing sequence. Runs in the HTTP (tokenizer) process.
"""

from __future__ import annotations

from sgl_multilora.adapters import find_invocation_start
from sgl_multilora.patches import lora_remote
from sgl_multilora.patches.state import process_state


def validate_one_request(result, self, obj, input_ids, *args, **kwargs):
    """AFTER hook on `TokenizerManager._validate_one_request(obj, input_ids)`: raises ValueError (HTTP 400)."""
    name = getattr(obj, "lora_path", None)
    if not isinstance(name, str) or input_ids is None:
        return result
    ref = getattr(self, "lora_ref_cache", {}).get(name)
    if ref is None:
        return result
    if lora_remote.is_remote(ref.lora_path):
        invocation = lora_remote.invocation_tokens(ref.lora_path)
    else:
        invocation = process_state().adapters.invocation_tokens(ref.lora_path)
    if invocation is not None and find_invocation_start(list(input_ids), invocation) is None:
        text = self.tokenizer.decode(list(invocation)) if getattr(self, "tokenizer", None) is not None else ""
        raise ValueError(
            f"aLoRA adapter '{name}' activates at its invocation sequence {list(invocation)} ({text!r}), "
            "which does not occur in the prompt; append it where the adapter should start to apply"
        )
    return result

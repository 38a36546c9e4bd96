"""SGLang's own reading of an adapter directory, made to accept every PEFT LoRA layout we serve.

Lives here: two hooks on SGLang's LoRA loading (`sglang.srt.lora`), both on every LoRA path (ours on the
transformers model, SGLang's layers and `--lora-backend multilora`):
- `fill_missing_qkv`: SGLang stacks q/k/v into one `qkv_proj` and reads `v_proj` (and `q_proj`) unconditionally,
  so an adapter on `q_proj` alone (or `q_proj` and `k_proj`, or with `layers_to_transform`) failed to load with a
  bare KeyError. The missing ones get zero weights: zero A and B are exactly "no LoRA on that projection".
- `resolve_pattern_targets`: PEFT writes `target_modules` as a regex string when it was given one; SGLang accepts
  only "all" / "all-linear" there. The modules are the ones the weight file holds (`adapters.weight_modules`,
  which our own registry uses too), so both sides agree on them.
Not here: our validation and loading (`sgl_multilora/adapters.py`, `lora_transformers.py`).
"""

from __future__ import annotations

import os
import re

from sgl_multilora.adapters import weight_modules

_QKV = ("q_proj", "k_proj", "v_proj")
# `...layers.3.self_attn.q_proj.lora_A.weight` -> ("...layers.3.self_attn.", "q_proj", "A", ".weight")
_QKV_KEY = re.compile(r"^(.*\.)(q_proj|k_proj|v_proj)\.lora_([AB])(\..*)?$")


def _out_features(config, module: str) -> int:
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if module == "q_proj":
        return heads * head_dim
    return (getattr(config, "num_key_value_heads", None) or heads) * head_dim


def fill_missing_qkv(self, weight_names, weights, *args, **kwargs):
    """Before `LoRAAdapter.normalize_qkv_proj`: wherever a layer has LoRA weights on some of q/k/v, the others
    get zeros (A: the present A's shape; B: (that projection's output width, rank)). Returns the arguments with the
    added names, or None when nothing is missing."""
    present: dict[tuple[str, str, str], dict[str, str]] = {}  # (prefix, half, suffix) -> module -> name
    for name in weight_names:
        m = _QKV_KEY.match(name)
        if m is not None:
            prefix, module, half, suffix = m.group(1), m.group(2), m.group(3), m.group(4) or ""
            present.setdefault((prefix, half, suffix), {})[module] = name
    added = []
    for (prefix, half, suffix), modules in present.items():
        like = weights[next(iter(modules.values()))]
        for module in _QKV:
            if module in modules:
                continue
            name = f"{prefix}{module}.lora_{half}{suffix}"
            if half == "A":
                weights[name] = like.new_zeros(like.shape)
            else:  # (out, rank), possibly with leading dims (experts) kept from the present one
                weights[name] = like.new_zeros((*like.shape[:-2], _out_features(self.base_hf_config, module),
                                                like.shape[-1]))
            added.append(name)
    if not added:
        return None
    return (self, [*weight_names, *added], weights, *args), kwargs


def resolve_pattern_targets(result, self, path=None, *args, **kwargs):
    """After `LoRAConfig.__init__`: a pattern `target_modules` (a string) of an adapter directory on disk becomes
    the list of modules its weight file holds."""
    targets = getattr(self, "target_modules", None)
    if not isinstance(targets, str) or not path or not os.path.isdir(path):
        return None
    found = list(weight_modules(path))
    if found:
        self.target_modules = found
        self.hf_config = {**self.hf_config, "target_modules": found}
    return None

"""SGLang's own reading of adapter directories (`patches/lora_load.py`) on its real classes: adapters that leave
out some of q/k/v, and PEFT's regex `target_modules`. The server-level checks (start-up and run-time loads, outputs
equal to PEFT's) are in `tests/e2e/test_unified_pool.py`."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from safetensors.torch import save_file

from sgl_multilora.patches.lora_load import fill_missing_qkv, resolve_pattern_targets

RANK = 4
PREFIX = "base_model.model.model.layers.{}.self_attn.{}"


@pytest.fixture(scope="module")
def hf_config():
    from transformers import AutoConfig

    from sgl_multilora.embedded import ensure_embedded_model

    return AutoConfig.from_pretrained(str(ensure_embedded_model()))


def _weights(hf_config, modules, layers=(0, 1)) -> dict[str, torch.Tensor]:
    hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
    head_dim = hidden // heads
    out = {"q_proj": heads * head_dim, "k_proj": hf_config.num_key_value_heads * head_dim}
    out["v_proj"] = out["k_proj"]
    g = torch.Generator().manual_seed(0)
    w = {}
    for layer in layers:
        for module in modules:
            name = PREFIX.format(layer, module)
            w[f"{name}.lora_A.weight"] = torch.randn(RANK, hidden, generator=g)
            w[f"{name}.lora_B.weight"] = torch.randn(out[module], RANK, generator=g)
    return w


def _sglang_normalize():
    """SGLang's own `normalize_qkv_proj` (unwrapped, in case a test before this one applied the plugin's hooks)."""
    from sglang.srt.lora.lora import LoRAAdapter

    return inspect.unwrap(LoRAAdapter.normalize_qkv_proj)


def _normalize(hf_config, weights: dict) -> dict:
    """SGLang's `normalize_qkv_proj` after our hook, as the HookRegistry's "before" wrapper runs them."""
    from sglang.srt.lora.lora import LoRAAdapter

    adapter = object.__new__(LoRAAdapter)  # the normalization reads only the weights and the model config
    object.__setattr__(adapter, "base_hf_config", hf_config)
    args, kwargs = (adapter, list(weights), weights), {}
    changed = fill_missing_qkv(*args)
    if changed is not None:
        args, kwargs = changed
    _sglang_normalize()(*args, **kwargs)
    return weights


def test_without_the_hook_sglang_fails_on_q_proj_alone(hf_config):
    from sglang.srt.lora.lora import LoRAAdapter

    adapter = object.__new__(LoRAAdapter)
    weights = _weights(hf_config, ["q_proj"])
    with pytest.raises(KeyError, match="v_proj"):
        _sglang_normalize()(adapter, list(weights), weights)


@pytest.mark.parametrize("modules", [["q_proj"], ["q_proj", "k_proj"], ["k_proj", "v_proj"], ["v_proj"]])
def test_missing_projections_are_stacked_as_zeros(hf_config, modules):
    original = _weights(hf_config, modules)
    weights = _normalize(hf_config, dict(original))
    sizes = {m: _weights(hf_config, ["q_proj", "k_proj", "v_proj"], layers=(0,))[PREFIX.format(0, m) + ".lora_B.weight"]
             .shape[0] for m in ("q_proj", "k_proj", "v_proj")}
    for layer in (0, 1):
        qkv = PREFIX.format(layer, "qkv_proj")
        a, b = weights[f"{qkv}.lora_A.weight"], weights[f"{qkv}.lora_B.weight"]
        assert a.shape == (3 * RANK, hf_config.hidden_size) and b.shape == (sum(sizes.values()), RANK)
        row = 0
        for i, module in enumerate(("q_proj", "k_proj", "v_proj")):
            name = PREFIX.format(layer, module)
            a_part, b_part = a[i * RANK:(i + 1) * RANK], b[row:row + sizes[module]]
            row += sizes[module]
            if module in modules:
                assert torch.equal(a_part, original[f"{name}.lora_A.weight"])
                assert torch.equal(b_part, original[f"{name}.lora_B.weight"])
            else:
                assert not a_part.any() and not b_part.any(), f"{module} must be zero: it has no LoRA"
        assert not [k for k in weights if k.startswith(PREFIX.format(layer, "")) and "qkv_proj" not in k]


def test_an_adapter_with_every_projection_is_left_as_sglang_stacks_it(hf_config):
    weights = _weights(hf_config, ["q_proj", "k_proj", "v_proj"])
    assert fill_missing_qkv(object(), list(weights), weights) is None


def test_a_regex_target_modules_becomes_the_modules_the_weights_hold(tmp_path, hf_config):
    from sglang.srt.lora.lora_config import LoRAConfig

    save_file(_weights(hf_config, ["q_proj", "v_proj"]), str(tmp_path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": RANK, "lora_alpha": 8, "target_modules": r".*\.(q_proj|v_proj)"}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    lora_config = LoRAConfig(str(tmp_path))
    resolve_pattern_targets(None, lora_config, str(tmp_path))
    assert lora_config.target_modules == ["q_proj", "v_proj"]
    assert lora_config.hf_config["target_modules"] == ["q_proj", "v_proj"]
    from sglang.srt.lora.utils import get_normalized_target_modules

    assert get_normalized_target_modules(lora_config.target_modules) == {"qkv_proj"}

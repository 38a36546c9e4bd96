"""The expert adapters bundled in `assets/moe_adapters/` for the embedded MoE model: the manifest matches the files,
each loads with our loader against the MoE model's shape, and with PEFT each visibly does its task.

The dense bundle's equivalent is `test_bundled_adapters.py`; these adapters target only the fused experts
(`target_parameters`), so they are kept apart from `assets/adapters/`, which test servers load onto the dense model.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from sgl_multilora.adapters import EXPERT_MODULES, expert_unit, load_adapter
from sgl_multilora.embedded_moe import EMBEDDED_MOE_NAME, NUM_EXPERTS
from tests.unit.test_bundled_adapters import _tasks_module

MOE_ADAPTERS_DIR = Path(__file__).resolve().parents[2] / "assets" / "moe_adapters"
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
NUM_LAYERS = 30
MAX_NEW_TOKENS = 12
MANIFEST = json.loads((MOE_ADAPTERS_DIR / "manifest.json").read_text())
ENTRIES = MANIFEST["adapters"]


def _short_check(check: dict, output: str) -> bool:
    """A manifest check, as a MAX_NEW_TOKENS-token output can pass it: a JSON object is only begun."""
    if check["type"] == "json_object_with_key":
        return output.startswith('{"' + check["key"] + '"')
    return _tasks_module().run_check(check, output)


def test_manifest_describes_expert_only_float16_adapters() -> None:
    assert MANIFEST["base_model"] == EMBEDDED_MOE_NAME
    names = [e["name"] for e in ENTRIES]
    assert len(names) >= 2 and len(names) == len(set(names))
    assert sorted(p.name for p in MOE_ADAPTERS_DIR.iterdir() if p.is_dir()) == sorted(names)
    for entry in ENTRIES:
        assert entry["kind"] == "lora" and entry["rank"] in (4, 8) and entry["alpha"] == 2 * entry["rank"]
        assert entry["target_parameters"] == EXPERT_PARAMS and "target_modules" not in entry
        assert entry["weights_dtype"] == "float16"
        num_passed, num_total = map(int, entry["heldout_passed"].split("/"))
        assert num_passed >= 6 and num_total == 8, entry["heldout_passed"]
        for check in entry["checks"]:
            assert _tasks_module().run_check(check, entry["example_output"]), (check, entry["example_output"])


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e["name"])
def test_files_match_the_manifest(entry: dict) -> None:
    """PEFT config and weights: the experts only (PEFT nests one wrapper per parameter, so each layer's experts
    module holds two A/B pairs: `experts.base_layer.lora_*` and `experts.lora_*`), stored float16, trained."""
    path = MOE_ADAPTERS_DIR / entry["name"]
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"]) == (entry["rank"], entry["alpha"])
    assert sorted(config["target_parameters"]) == sorted(entry["target_parameters"])
    assert not config.get("target_modules"), config.get("target_modules")
    assert config["base_model_name_or_path"] == EMBEDDED_MOE_NAME
    assert config.get("alora_invocation_tokens") is None
    weights = path / "adapter_model.safetensors"
    assert weights.stat().st_size == entry["size_bytes"]
    with safe_open(str(weights), framework="numpy") as f:
        keys = set(f.keys())
        prefixes = {f"base_model.model.model.layers.{i}.mlp.experts.{inner}" for i in range(NUM_LAYERS)
                    for inner in ("base_layer.", "")}
        assert keys == {f"{p}lora_{ab}.weight" for p in prefixes for ab in "AB"}
        for key in keys:
            tensor = f.get_tensor(key)
            assert tensor.dtype == np.float16 and np.isfinite(tensor).all(), key
            assert ".lora_B." not in key or np.abs(tensor).max() > 0, f"{key} is all zero: not trained"


@pytest.fixture(scope="module")
def moe_shape(moe_model_path):
    """The MoE model's shape as a served model's LoRA layers see it (`test_expert_lora.served_model`)."""
    from tests.unit.test_expert_lora import served_model

    return served_model(moe_model_path)[1]


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e["name"])
def test_loads_against_the_moe_models_shape(entry: dict, moe_shape) -> None:
    adapter = load_adapter(MOE_ADAPTERS_DIR / entry["name"], moe_shape)
    assert adapter.spec.rank == entry["rank"] and adapter.spec.scaling == entry["alpha"] / entry["rank"]
    assert set(adapter.spec.target_modules) == set(EXPERT_MODULES)
    assert set(adapter.weights) == {(layer, expert_unit(module, e)) for layer in range(NUM_LAYERS)
                                    for module in EXPERT_MODULES for e in range(NUM_EXPERTS)}
    a, b = adapter.weights[(0, expert_unit("experts.gate_up_proj", 0))]
    assert a.shape == (entry["rank"], 576) and b.shape == (2 * 1536, entry["rank"])


@pytest.fixture(scope="module")
def peft_moe(moe_model_path):
    """The MoE model with every bundled expert adapter loaded through PEFT."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(moe_model_path, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, str(MOE_ADAPTERS_DIR / ENTRIES[0]["name"]), adapter_name=ENTRIES[0]["name"])
    for entry in ENTRIES[1:]:
        model.load_adapter(str(MOE_ADAPTERS_DIR / entry["name"]), adapter_name=entry["name"])
    return model.eval()


@torch.no_grad()
def greedy(model, tokenizer, text: str) -> str:
    ids = tokenizer(text, return_tensors="pt").input_ids
    out = model.generate(input_ids=ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


@pytest.fixture(scope="module")
def base_answers(peft_moe, tokenizer) -> dict[str, str]:
    """The base model's greedy answer to each example input text, computed before any adapter is merged."""
    with peft_moe.disable_adapter():
        return {text: greedy(peft_moe, tokenizer, text) for text in {e["example_input_text"] for e in ENTRIES}}


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e["name"])
def test_example_answer_differs_from_the_base_models_and_passes_its_check(entry: dict, peft_moe, base_answers,
                                                                          tokenizer) -> None:
    """Greedy, MAX_NEW_TOKENS tokens: the adapter's answer to its example prompt is not the base model's and passes
    its check (for a JSON answer: it opens the object with its key). The adapter is merged for the generation: PEFT's
    unmerged fused-experts wrapper rebuilds every expert's delta weight at each step (18 s for 12 tokens, 2 merged)."""
    text = entry["example_input_text"]
    assert entry["example_prompt"] in text
    base = base_answers[text]
    peft_moe.set_adapter(entry["name"])
    peft_moe.merge_adapter()
    try:
        adapted = greedy(peft_moe, tokenizer, text)
    finally:
        peft_moe.unmerge_adapter()
    assert adapted != base, f"{entry['name']} answers as the base model does: {base!r}"
    for check in entry["checks"]:
        assert _short_check(check, adapted), (check, adapted, base)

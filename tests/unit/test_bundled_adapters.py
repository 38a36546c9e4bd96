"""The adapters bundled in `assets/adapters/`: valid PEFT files whose shapes fit the embedded model.

Reads only the manifest, the configs and the safetensors headers/weights; needs no model or tokenizer.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

ADAPTERS_DIR = Path(__file__).resolve().parents[2] / "assets" / "adapters"
NUM_LAYERS = 30
# projection -> (in_features, out_features) of SmolLM2-135M (hidden 576, 3 kv heads x 64, mlp 1536)
DIMS = {
    "q_proj": (576, 576), "k_proj": (576, 192), "v_proj": (576, 192), "o_proj": (576, 576),
    "gate_proj": (576, 1536), "up_proj": (576, 1536), "down_proj": (1536, 576),
}
PARENT = {name: "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp" for name in DIMS}


def _manifest() -> dict:
    return json.loads((ADAPTERS_DIR / "manifest.json").read_text())


ENTRIES = _manifest()["adapters"]


def _tasks_module():
    """`tools/adapter_tasks.py`, imported by path (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "adapter_tasks", ADAPTERS_DIR.parents[1] / "tools" / "adapter_tasks.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_manifest_names_the_expected_mix() -> None:
    names = [e["name"] for e in ENTRIES]
    assert len(names) == len(set(names))
    kinds = {e["kind"] for e in ENTRIES}
    assert kinds == {"lora", "alora"}
    assert len({e["rank"] for e in ENTRIES}) >= 3, "bundle should cover several ranks"
    for entry in ENTRIES:
        assert (ADAPTERS_DIR / entry["name"]).is_dir(), entry["name"]


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e["name"])
def test_adapter_config(entry: dict) -> None:
    config = json.loads((ADAPTERS_DIR / entry["name"] / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA"
    assert config["task_type"] == "CAUSAL_LM"
    assert config["r"] == entry["rank"]
    assert config["lora_alpha"] == entry["alpha"]
    assert sorted(config["target_modules"]) == sorted(entry["target_modules"])
    assert set(config["target_modules"]) <= set(DIMS)
    base = config["base_model_name_or_path"]
    assert "/" not in base and "://" not in base, f"base model must be a plain name, got {base!r}"
    invocation = config.get("alora_invocation_tokens")
    if entry["kind"] == "alora":
        assert invocation and all(isinstance(t, int) for t in invocation)
        assert invocation == entry["invocation_token_ids"]
        assert entry["invocation_text"] and entry["example_input_text"].endswith(entry["invocation_text"])
    else:
        assert invocation is None


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e["name"])
def test_weights_match_rank_and_model_dims(entry: dict) -> None:
    rank = entry["rank"]
    expected = {}
    for layer in range(NUM_LAYERS):
        for module in entry["target_modules"]:
            in_features, out_features = DIMS[module]
            prefix = f"base_model.model.model.layers.{layer}.{PARENT[module]}.{module}"
            expected[f"{prefix}.lora_A.weight"] = (rank, in_features)
            expected[f"{prefix}.lora_B.weight"] = (out_features, rank)
    path = ADAPTERS_DIR / entry["name"] / "adapter_model.safetensors"
    assert path.stat().st_size == entry["size_bytes"]
    with safe_open(str(path), framework="numpy") as f:
        assert set(f.keys()) == set(expected)
        for key, shape in expected.items():
            tensor = f.get_tensor(key)
            assert tensor.shape == shape, key
            assert np.isfinite(tensor).all(), key
            if ".lora_B." in key:
                assert np.abs(tensor).max() > 0, f"{key} is all zero: adapter was not trained"


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e["name"])
def test_recorded_example_passes_its_checks(entry: dict) -> None:
    tasks = _tasks_module()
    assert entry["checks"]
    for check in entry["checks"]:
        assert tasks.run_check(check, entry["example_output"]), (check, entry["example_output"])

"""Adapter records: config checks with clear errors, content identity, validation against a model, aLoRA's k."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from sgl_multilora.adapters import (
    AdapterError,
    ModelShape,
    ModuleDims,
    find_invocation_start,
    load_adapter,
    read_spec,
)

SHAPE = ModelShape(
    num_layers=2,
    modules={"q_proj": ModuleDims(8, 8), "v_proj": ModuleDims(8, 4)},
    max_rank=4,
)


def write_adapter(path, *, r=2, targets=("q_proj", "v_proj"), seed=0, **config):
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for module in targets:
            dims = SHAPE.modules.get(module, ModuleDims(8, 8))
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(r, dims.in_features, generator=g)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(dims.out_features, r, generator=g)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(targets), **config}
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path


def test_load_reads_every_layer_and_module(tmp_path):
    adapter = load_adapter(write_adapter(tmp_path / "a"), SHAPE)
    assert sorted(adapter.weights) == [(0, "q_proj"), (0, "v_proj"), (1, "q_proj"), (1, "v_proj")]
    a, b = adapter.weights[(1, "v_proj")]
    assert a.shape == (2, 8) and b.shape == (4, 2)
    assert adapter.spec.scaling == 2.0 and adapter.spec.name == "a" and not adapter.spec.is_alora


def test_loaded_weights_survive_the_file_being_rewritten_in_place(tmp_path):
    """A training job saving over a served adapter's file truncates it first: weights that mapped the file would
    kill the process with SIGBUS on their next read (a child process here, so a regression cannot take pytest
    down). The loaded weights are the bytes read at load time."""
    import subprocess
    import sys

    path = write_adapter(tmp_path / "a")
    code = (
        "import sys, torch\n"
        "from sgl_multilora.adapters import load_adapter, ModelShape, ModuleDims\n"
        "shape = ModelShape(2, {'q_proj': ModuleDims(8, 8), 'v_proj': ModuleDims(8, 4)}, max_rank=4)\n"
        f"adapter = load_adapter({str(path)!r}, shape)\n"
        "before = sum(float(a.sum()) + float(b.sum()) for a, b in adapter.weights.values())\n"
        f"open({str(path / 'adapter_model.safetensors')!r}, 'wb').close()\n"
        "after = sum(float(a.sum()) + float(b.sum()) for a, b in adapter.weights.values())\n"
        "print(before == after)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-500:]}"
    assert done.stdout.strip() == "True"


def test_the_identity_names_the_bytes_served_when_the_file_changes_during_the_load(tmp_path, monkeypatch):
    """The file is rewritten after its config was read and before its weights are: the adapter loaded carries the
    identity of the bytes it serves (the new ones), never the old identity with the new weights."""
    import builtins

    path, other = write_adapter(tmp_path / "a"), write_adapter(tmp_path / "b", seed=1)
    before = read_spec(path).identity
    real_open = builtins.open

    def open_rewritten(file, *args, **kwargs):  # the weight file's bytes as rewritten meanwhile
        if str(file) == str(path / "adapter_model.safetensors"):
            file = other / "adapter_model.safetensors"
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", open_rewritten)
    adapter = load_adapter(path, SHAPE)
    monkeypatch.undo()
    served = load_adapter(other, SHAPE)
    assert adapter.spec.identity != before
    assert adapter.spec.identity == read_spec(path, data=(other / "adapter_model.safetensors").read_bytes()).identity
    assert all(torch.equal(adapter.weights[k][0], served.weights[k][0]) for k in served.weights)


def test_a_file_grown_past_the_limit_after_its_check_is_refused(tmp_path, monkeypatch):
    from sgl_multilora import adapters

    path = write_adapter(tmp_path / "a")
    size = (path / "adapter_model.safetensors").stat().st_size
    monkeypatch.setattr(adapters, "_check_size", lambda *args: None)  # the size checked before it grew
    with pytest.raises(AdapterError, match="above the"):
        load_adapter(path, SHAPE, max_weights_bytes=size - 1)


def test_rslora_scaling(tmp_path):
    spec = read_spec(write_adapter(tmp_path / "a", r=4, use_rslora=True))
    assert spec.scaling == pytest.approx(8 / 2)


def test_identity_is_content_not_name(tmp_path):
    a = read_spec(write_adapter(tmp_path / "a", seed=0))
    same_weights_other_name = read_spec(write_adapter(tmp_path / "b", seed=0))
    changed_weights = read_spec(write_adapter(tmp_path / "a", seed=1))
    assert a.identity == same_weights_other_name.identity
    assert changed_weights.identity != a.identity


def _set_config(path, **fields):
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, **fields}))


@pytest.mark.parametrize("pattern", [r".*\.(q_proj|v_proj)", r"model\.layers\.\d+\.self_attn\.[qv]_proj", "all-linear"])
def test_a_pattern_target_modules_is_resolved_from_the_weights(tmp_path, pattern):
    """PEFT writes a regex `target_modules` as a string; the modules are the ones the pattern selected."""
    path = write_adapter(tmp_path / "a")
    reference = load_adapter(path, SHAPE)
    _set_config(path, target_modules=pattern)
    adapter = load_adapter(path, SHAPE)
    assert adapter.spec.target_modules == ("q_proj", "v_proj")
    assert sorted(adapter.weights) == sorted(reference.weights)
    assert adapter.spec.identity == reference.spec.identity  # the same modules and weights: the same adapter


def test_dotted_target_modules_name_the_module_at_their_end(tmp_path):
    """PEFT matches `["self_attn.q_proj", ...]` as the end of each module's path."""
    path = write_adapter(tmp_path / "a")
    _set_config(path, target_modules=["self_attn.q_proj", "model.layers.0.self_attn.v_proj", "v_proj"])
    assert load_adapter(path, SHAPE).spec.target_modules == ("q_proj", "v_proj")


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda p: (p / "adapter_config.json").unlink(), "adapter_config.json is missing"),
        (lambda p: (p / "adapter_model.safetensors").unlink(), "adapter_model.safetensors is missing"),
        (lambda p: (p / "adapter_config.json").write_text("[1, 2"), "not valid JSON"),
        (lambda p: (p / "adapter_config.json").write_text('{"r": 2, "target_modules": "all"}'), "target_modules"),
        (lambda p: (p / "adapter_config.json").write_text('{"r": 0, "target_modules": ["q_proj"]}'), "'r'"),
        (lambda p: (p / "adapter_config.json").write_text(
            '{"peft_type": "IA3", "r": 2, "target_modules": ["q_proj"]}'), "peft_type 'IA3'"),
        (lambda p: (p / "adapter_model.safetensors").write_bytes(b"garbage"), "is not a readable safetensors file"),
        (lambda p: _set_config(p, bias="all"), "LoRA bias terms ('bias': 'all') are not supported"),
        (lambda p: _set_config(p, modules_to_save=["lm_head"]), "'modules_to_save' ['lm_head'] is not supported"),
        (lambda p: _set_config(p, lora_bias=True), "'lora_bias' (a trained bias on lora_B) is not supported"),
        (lambda p: _set_config(p, trainable_token_indices=[5, 7]), "'trainable_token_indices' is not supported"),
        (lambda p: _set_config(p, layer_replication=[[0, 2], [1, 2]]),
         "'layer_replication' [[0, 2], [1, 2]] is not supported"),
        (lambda p: _set_config(p, target_modules=r".*\.q_proj"),
         r"pattern '.*\\.q_proj' does not select 'model.layers.0.self_attn.v_proj'"),
        (lambda p: _set_config(p, target_modules="(q_proj"), "is not a valid regular expression"),
    ],
)
def test_malformed_adapter_names_the_problem(tmp_path, mutate, message):
    path = write_adapter(tmp_path / "broken")
    mutate(path)
    with pytest.raises(AdapterError, match="LoRA adapter 'broken'") as info:
        load_adapter(path, SHAPE)
    assert message in str(info.value)


def test_missing_directory(tmp_path):
    with pytest.raises(AdapterError, match="does not exist"):
        load_adapter(tmp_path / "nowhere", SHAPE, name="x")


@pytest.mark.parametrize("module", ["lm_head", "embed_tokens"])
def test_a_target_outside_the_decoder_layers_is_named_as_unsupported(tmp_path, module):
    with pytest.raises(AdapterError, match=rf"LoRA on \['{module}'\] is not supported: only the decoder layers'"):
        load_adapter(write_adapter(tmp_path / "head", targets=("q_proj", module)), SHAPE)


def test_rank_above_server_limit(tmp_path):
    with pytest.raises(AdapterError, match="rank 8 exceeds the server's maximum LoRA rank 4"):
        load_adapter(write_adapter(tmp_path / "big", r=8), SHAPE)


def test_target_module_the_model_lacks(tmp_path):
    with pytest.raises(AdapterError, match=r"target modules \['c_attn'\] do not exist"):
        load_adapter(write_adapter(tmp_path / "gpt2ish", targets=("q_proj", "c_attn")), SHAPE)


def test_shape_mismatch(tmp_path):
    other = ModelShape(2, {"q_proj": ModuleDims(16, 8), "v_proj": ModuleDims(8, 4)}, max_rank=4)
    with pytest.raises(AdapterError, match="do not match rank 2"):
        load_adapter(write_adapter(tmp_path / "a"), other)


def test_alora_invocation_tokens(tmp_path):
    spec = read_spec(write_adapter(tmp_path / "a", alora_invocation_tokens=[5, 6]))
    assert spec.is_alora and spec.alora_invocation_tokens == (5, 6)
    with pytest.raises(AdapterError, match="alora_invocation_tokens"):
        read_spec(write_adapter(tmp_path / "b", alora_invocation_tokens=[]))


@pytest.mark.parametrize(
    "ids, invocation, k",
    [
        ([1, 5, 6, 2, 5, 6, 3], (5, 6), 4),  # the last occurrence
        ([5, 6], (5, 6), 0),
        ([1, 2, 3], (5, 6), None),
        ([1, 5], (5, 6), None),  # a partial occurrence at the end does not count
        ([5, 5, 5], (5, 5), 1),
    ],
)
def test_find_invocation_start(ids, invocation, k):
    assert find_invocation_start(ids, invocation) == k


def _as_pickled(path):
    """The adapter at `path` with its weights saved as PEFT's `safe_serialization=False` saves them."""
    from safetensors.torch import load_file

    tensors = load_file(str(path / "adapter_model.safetensors"))
    (path / "adapter_model.safetensors").unlink()
    torch.save(tensors, str(path / "adapter_model.bin"))
    return path


def test_pickled_weights_load_as_the_safetensors_ones(tmp_path):
    reference = load_adapter(write_adapter(tmp_path / "st", seed=3), SHAPE)
    pickled = load_adapter(_as_pickled(write_adapter(tmp_path / "bin", seed=3)), SHAPE)
    assert sorted(pickled.weights) == sorted(reference.weights)
    for key, (a, b) in reference.weights.items():
        assert torch.equal(pickled.weights[key][0], a) and torch.equal(pickled.weights[key][1], b)
    assert pickled.spec.scaling == reference.spec.scaling and len(pickled.spec.identity) == 64


class _Exploit:
    def __reduce__(self):
        import os

        return (os.system, ("touch exploited",))


@pytest.mark.parametrize("payload, message", [
    (b"not a pickle", "is not a readable PyTorch weights file"),
    ("exploit", "is not a readable PyTorch weights file"),
    ([1, 2, 3], "must hold a dict of named tensors"),
])
def test_a_pickled_weight_file_runs_no_code_and_bad_ones_are_named(tmp_path, monkeypatch, payload, message):
    path = _as_pickled(write_adapter(tmp_path / "bad"))
    if payload == "exploit":
        import pickle

        (path / "adapter_model.bin").write_bytes(pickle.dumps(_Exploit()))
    elif isinstance(payload, bytes):
        (path / "adapter_model.bin").write_bytes(payload)
    else:
        torch.save(payload, str(path / "adapter_model.bin"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(AdapterError, match="LoRA adapter 'bad'") as info:
        load_adapter(path, SHAPE)
    assert message in str(info.value) and "adapter_model.bin" in str(info.value)
    assert not (tmp_path / "exploited").exists(), "the weight file ran code"

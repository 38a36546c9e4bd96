"""Where adapters may come from and what their files may hold: the adapter root (traversal, symlinks, absolute
paths), size limits, malformed safetensors. Every refusal is an AdapterError; none crashes or leaks the path."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from sgl_multilora.adapters import (
    MAX_CONFIG_BYTES,
    AdapterError,
    load_adapter,
    read_config,
    read_spec,
    resolve_under_root,
)
from tests.unit.test_adapters import SHAPE, write_adapter

OUTSIDE = "outside the directories this server loads adapters from"


@pytest.fixture
def tree(tmp_path):
    """root/ holds adapter `good`; `secret/` lies beside root; root/link points out of it, root/inner into it."""
    root = tmp_path / "root"
    write_adapter(root / "good")
    write_adapter(tmp_path / "secret" / "adapter")
    os.symlink(tmp_path / "secret", root / "link")
    os.symlink(root / "good", root / "inner")
    return root


def test_paths_inside_the_root_resolve(tree):
    assert resolve_under_root("good", tree, "a") == tree / "good"
    assert resolve_under_root(str(tree / "good"), tree, "a") == tree / "good"
    assert resolve_under_root("inner", tree, "a") == tree / "good"  # a symlink that stays inside is fine
    assert resolve_under_root("good/../good", tree, "a") == tree / "good"
    assert resolve_under_root("missing", tree, "a") == tree / "missing"  # existence is checked when reading


@pytest.mark.parametrize("path", [
    "../secret/adapter",
    "good/../../secret/adapter",
    "link/adapter",  # a symlink out of the root
    "/etc",
    "/",
    "..",
    "/nonexistent/dir",
])
def test_paths_outside_the_root_are_refused_without_detail(tree, path):
    with pytest.raises(AdapterError) as info:
        resolve_under_root(path, tree, "probe")
    message = str(info.value)
    assert OUTSIDE in message
    for leak in ("secret", "etc", "nonexistent", "exist", str(tree)):
        assert leak not in message, f"the refusal of {path!r} tells the caller {leak!r}: {message}"


def test_refusal_does_not_depend_on_whether_the_path_exists(tree):
    assert str(pytest.raises(AdapterError, resolve_under_root, "/etc", tree, "p").value) == str(
        pytest.raises(AdapterError, resolve_under_root, "/no/such/dir", tree, "p").value)


def test_relative_paths_follow_the_given_base(tree, tmp_path):
    assert resolve_under_root("root/good", tree, "a", relative_to=tmp_path) == tree / "good"
    with pytest.raises(AdapterError, match=OUTSIDE):
        resolve_under_root("secret/adapter", tree, "a", relative_to=tmp_path)


def test_weight_file_above_the_limit_is_refused_naming_both_sizes(tmp_path):
    path = write_adapter(tmp_path / "big")
    size = (path / "adapter_model.safetensors").stat().st_size
    with pytest.raises(AdapterError, match=r"MiB, above the 0 MiB limit per adapter \(--multilora-max-adapter-mb\)"):
        read_spec(path, "big", max_weights_bytes=size - 1)
    assert read_spec(path, "big", max_weights_bytes=size).rank == 2


def test_oversized_config_is_refused(tmp_path):
    path = write_adapter(tmp_path / "a")
    (path / "adapter_config.json").write_text(" " * (MAX_CONFIG_BYTES + 1))
    with pytest.raises(AdapterError, match="adapter_config.json is 1.0 MiB, above the 1 MiB limit"):
        read_config(path)


@pytest.mark.parametrize("corrupt", ["garbage", "truncated", "huge_header", "empty"])
def test_malformed_safetensors_get_a_clear_error(tmp_path, corrupt):
    path = write_adapter(tmp_path / "a")
    weights = path / "adapter_model.safetensors"
    data = weights.read_bytes()
    if corrupt == "garbage":
        weights.write_bytes(os.urandom(len(data)))
    elif corrupt == "truncated":
        weights.write_bytes(data[: len(data) // 2])
    elif corrupt == "huge_header":  # a header length far beyond the file
        weights.write_bytes((1 << 40).to_bytes(8, "little") + data[8:])
    else:
        weights.write_bytes(b"")
    with pytest.raises(AdapterError, match="adapter_model.safetensors is not a readable safetensors file"):
        load_adapter(path, SHAPE)


def test_non_float_and_non_finite_weights_are_refused(tmp_path):
    path = write_adapter(tmp_path / "a", targets=("q_proj",))
    prefix = "base_model.model.model.layers.{}.self_attn.q_proj"
    tensors = {}
    for layer in range(2):
        tensors[f"{prefix.format(layer)}.lora_A.weight"] = torch.ones(2, 8)
        tensors[f"{prefix.format(layer)}.lora_B.weight"] = torch.ones(8, 2)
    tensors[f"{prefix.format(1)}.lora_B.weight"] = torch.full((8, 2), float("nan"))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="holds NaN or infinite values"):
        load_adapter(path, SHAPE)
    tensors[f"{prefix.format(1)}.lora_B.weight"] = torch.ones(8, 2, dtype=torch.int32)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="has dtype torch.int32; LoRA weights are floating point"):
        load_adapter(path, SHAPE)


def test_config_that_is_not_an_object_or_not_json(tmp_path):
    path = write_adapter(tmp_path / "a")
    (path / "adapter_config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(AdapterError, match="must hold a JSON object"):
        read_config(path)
    (path / "adapter_config.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(AdapterError, match="is not valid JSON"):
        read_config(path)

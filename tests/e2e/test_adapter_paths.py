"""End to end: `--multilora-adapter-root` and `--multilora-max-adapter-mb` on a real CPU server.

Loads outside the root (`..`, a symlink out of it, absolute paths, existing or not) get HTTP 400 with one message
that reveals nothing about the path; oversize and malformed adapter files get a 400 naming the problem; adapters
inside the root load and serve PEFT's output; the server keeps serving throughout and holds no stray adapter.
"""

from __future__ import annotations

import os
import shutil

import pytest
import requests

from tests.conftest import ADAPTERS_DIR, start_server
from tests.oracle import assert_matches, logprob_fields

pytestmark = pytest.mark.e2e

OUTSIDE = "outside the directories this server loads adapters from"
MAX_MB = 2  # caps (1.8 MB) and check_caps (1.3 MB) fit; rate_length (2.6 MB) does not


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    """root/ holds copies of caps and check_caps, an oversize adapter, a malformed one and a symlink out of the root;
    outside/ holds a valid adapter the server must never load."""
    base = tmp_path_factory.mktemp("adapter_paths")
    root, outside = base / "root", base / "outside"
    root.mkdir()
    for name in ("caps", "check_caps"):
        shutil.copytree(ADAPTERS_DIR / name, root / name)
    shutil.copytree(ADAPTERS_DIR / "rate_length", root / "oversize")
    shutil.copytree(ADAPTERS_DIR / "caps", root / "malformed")
    weights = root / "malformed" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    shutil.copytree(ADAPTERS_DIR / "caps", outside / "caps")
    os.symlink(outside, root / "escape")
    return root, outside


@pytest.fixture(scope="module")
def server(model_path, layout):
    root, _ = layout
    handle = start_server(model_path, [
        "--enable-lora", "--lora-paths", f"caps={root / 'caps'}", "--max-loras-per-batch", "4",
        "--max-lora-rank", "32", "--multilora-adapter-root", str(root), "--multilora-max-adapter-mb", str(MAX_MB),
    ], name="e2e_adapter_paths")
    yield handle
    handle.stop()


def load(server, name: str, path: str) -> requests.Response:
    return requests.post(server.url + "/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=300)


def generate(server, input_ids, lora=None) -> requests.Response:
    return requests.post(server.url + "/generate", json={
        "input_ids": input_ids, "lora_path": lora, **logprob_fields(),
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
    }, timeout=300)


def loaded_names(server) -> set[str]:
    stats = requests.get(server.url + "/multilora/stats", timeout=60).json()
    return set(stats["memory"][0]["adapters"]["weights"])


def test_paths_outside_the_root_get_one_uninformative_400(server, layout, tokenizer):
    root, outside = layout
    probes = [str(outside / "caps"), "../outside/caps", "escape/caps", str(ADAPTERS_DIR / "json"), "/etc",
              "/no/such/dir", str(root / ".." / "outside" / "caps")]
    messages = set()
    for i, path in enumerate(probes):
        res = load(server, f"probe{i}", path)
        assert res.status_code == 400, (path, res.text)
        message = res.json()["error_message"]
        assert OUTSIDE in message, message
        for leak in ("outside/", "etc", "no/such", "exist", str(root)):
            assert leak not in message, f"the refusal of {path!r} reveals {leak!r}: {message}"
        messages.add(message.replace(f"probe{i}", "NAME"))
    assert len(messages) == 1, messages  # existing, missing, file or directory: the same answer
    assert loaded_names(server) == {"caps"}
    ids = tokenizer("The capital of France is", add_special_tokens=False).input_ids
    assert generate(server, ids).status_code == 200


def test_adapters_inside_the_root_load_by_relative_path_and_match_peft(server, layout, tokenizer, oracle):
    root, _ = layout
    res = load(server, "checker", "check_caps")  # relative to the root
    assert res.status_code == 200, res.text
    try:
        ids = tokenizer("Paris is the capital of France.", add_special_tokens=False).input_ids
        ids += list(oracle_invocation(root / "check_caps"))
        served = generate(server, ids, "checker")
        assert served.status_code == 200, served.text
        expected = oracle.greedy(str(root / "check_caps"), ids, 8, ignore_eos=True)
        assert_matches(served.json(), expected, "check_caps loaded by a relative path")
    finally:
        assert requests.post(server.url + "/unload_lora_adapter", json={"lora_name": "checker"},
                             timeout=120).status_code == 200


def oracle_invocation(adapter_dir) -> tuple[int, ...]:
    from sgl_multilora.adapters import read_config

    return tuple(read_config(adapter_dir)["alora_invocation_tokens"])


def test_oversize_and_malformed_files_get_a_400_naming_the_problem(server, tokenizer):
    res = load(server, "big", "oversize")
    assert res.status_code == 400
    assert f"above the {MAX_MB} MiB limit per adapter (--multilora-max-adapter-mb)" in res.json()["error_message"]
    res = load(server, "broken", "malformed")
    assert res.status_code == 400
    assert "adapter_model.safetensors is not a readable safetensors file" in res.json()["error_message"]
    assert loaded_names(server) == {"caps"}
    ids = tokenizer("The capital of France is", add_special_tokens=False).input_ids
    assert generate(server, ids, "caps").status_code == 200

"""Shared fixtures: the embedded model, the bundled adapters, the PEFT oracle, and a real CPU SGLang server."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ADAPTERS_DIR = Path(os.environ.get("MULTILORA_TEST_ADAPTERS_DIR", REPO / "assets" / "adapters"))


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_path() -> str:
    from sgl_multilora.embedded import ensure_embedded_model

    return str(ensure_embedded_model())


@pytest.fixture(scope="session")
def manifest() -> list[dict]:
    """The bundled adapters (assets/adapters/manifest.json), each with its absolute `path`."""
    entries = json.loads((ADAPTERS_DIR / "manifest.json").read_text())
    entries = entries["adapters"] if isinstance(entries, dict) else entries
    return [{**e, "path": str(ADAPTERS_DIR / e["name"])} for e in entries]


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="session")
def oracle(model_path, tokenizer):
    from tests.oracle import PeftOracle

    return PeftOracle(model_path, eos_token_ids={tokenizer.eos_token_id})


def start_server(model_path: str, extra_args: list[str], name: str):
    """Starts a CPU server for one test module; the caller stops it. Logs go to .pytest_cache/<name>.log."""
    from sgl_multilora.server import cpu_server_args, launch

    log_dir = REPO / ".pytest_cache"
    log_dir.mkdir(exist_ok=True)
    return launch(
        model_path,
        [*cpu_server_args(max_total_tokens=int(os.environ.get("MULTILORA_TEST_MAX_TOKENS", "8192"))), *extra_args],
        log_path=log_dir / f"{name}.log",
    )

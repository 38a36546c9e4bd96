"""The embedded model converter: the saved checkpoint matches the GGUF it came from, and it chats.

The oracle reads the GGUF with the `gguf` package's own reader and de-quantizer, independent of the
transformers conversion path. Conversion runs once per cache dir (the default one, shared with the suite).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from sgl_multilora.embedded import (
    COMPLETE_MARKER,
    EMBEDDED_MODEL_NAME,
    default_cache_dir,
    ensure_embedded_model,
    gguf_path,
)

pytestmark = pytest.mark.timeout(300)

# GGUF name -> HF name, for tensors that llama.cpp stores unpermuted (attn_q/attn_k are permuted).
UNPERMUTED = {
    "token_embd.weight": "model.embed_tokens.weight",
    "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
    "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
    "blk.17.ffn_gate.weight": "model.layers.17.mlp.gate_proj.weight",
    "blk.29.attn_output.weight": "model.layers.29.self_attn.o_proj.weight",
    "output_norm.weight": "model.norm.weight",
}


@pytest.fixture(scope="session")
def checkpoint() -> Path:
    return ensure_embedded_model()


@pytest.fixture(scope="session")
def gguf_tensors() -> dict[str, np.ndarray]:
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(gguf_path())
    wanted = set(UNPERMUTED) | {"blk.3.attn_q.weight", "blk.3.attn_k.weight"}
    return {
        t.name: gguf.quants.dequantize(t.data, t.tensor_type)
        for t in reader.tensors
        if t.name in wanted
    }


@pytest.fixture(scope="session")
def saved_tensors(checkpoint: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(checkpoint / "model.safetensors")


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of attn_q/attn_k rows.

    The GGUF converter maps HF row (head, half, i) to (head, i, half); this maps it back.
    """
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def test_checkpoint_layout_and_config(checkpoint: Path) -> None:
    assert checkpoint == default_cache_dir() / EMBEDDED_MODEL_NAME
    assert (checkpoint / COMPLETE_MARKER).is_file()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "chat_template.jinja"):
        assert (checkpoint / name).is_file(), name
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["hidden_size"] == 576
    assert config["intermediate_size"] == 1536
    assert config["num_hidden_layers"] == 30
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["vocab_size"] == 49152
    assert config["torch_dtype"] == config["dtype"] == "float32"
    assert config["eos_token_id"] == 2  # <|im_end|>
    assert "quantization_config" not in config, "checkpoint still claims to be GGUF-quantized"
    # No leftover temp dirs from the atomic rename.
    assert not [p for p in checkpoint.parent.iterdir() if p.name.startswith(f".{EMBEDDED_MODEL_NAME}.")]


def test_second_call_is_cached(checkpoint: Path) -> None:
    mtime = (checkpoint / "model.safetensors").stat().st_mtime_ns
    assert ensure_embedded_model() == checkpoint
    assert (checkpoint / "model.safetensors").stat().st_mtime_ns == mtime


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MULTILORA_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("MULTILORA_CACHE_DIR")
    assert default_cache_dir() == Path(os.path.expanduser("~")) / ".cache" / "sgl_multilora"


def test_weights_equal_dequantized_gguf(gguf_tensors, saved_tensors) -> None:
    for gguf_name, hf_name in UNPERMUTED.items():
        saved = saved_tensors[hf_name]
        assert saved.dtype == np.float32, hf_name
        np.testing.assert_array_equal(saved, gguf_tensors[gguf_name], err_msg=hf_name)
    np.testing.assert_array_equal(
        saved_tensors["model.layers.3.self_attn.q_proj.weight"],
        _unpermute(gguf_tensors["blk.3.attn_q.weight"], num_heads=9),
    )
    np.testing.assert_array_equal(
        saved_tensors["model.layers.3.self_attn.k_proj.weight"],
        _unpermute(gguf_tensors["blk.3.attn_k.weight"], num_heads=3),
    )


def test_tokenizer_round_trip_and_chat_template(checkpoint: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    text = "Multi-LoRA serving: 128 adapters, one base model!"
    ids = tokenizer(text).input_ids
    assert ids and tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token is not None
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="session")
def model_and_tokenizer(checkpoint: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    return model, tokenizer


def test_loaded_model_is_fp32_and_predicts_text(model_and_tokenizer) -> None:
    """A plain-text loss guards against silently wrong numerics (e.g. uninitialised rotary buffers).

    llama.cpp scores this paragraph at 2.38 nats/token with the same GGUF; a broken model scores > 4.
    """
    import torch

    model, tokenizer = model_and_tokenizer
    assert model.dtype == torch.float32
    text = (
        "Paris is the capital and largest city of France. With an estimated population of more than "
        "two million residents, it is the centre of the Ile-de-France region. The city is a major "
        "railway, highway, and air-transport hub served by two international airports."
    )
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    assert loss < 2.6, f"plain-text loss {loss:.2f}: weights or rotary embedding broken"


def test_greedy_chat_answer_mentions_paris(model_and_tokenizer) -> None:
    import torch

    model, tokenizer = model_and_tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer
    assert out[0, -1].item() == tokenizer.eos_token_id, "chat answer should end with <|im_end|>"

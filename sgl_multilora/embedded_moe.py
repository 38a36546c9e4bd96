"""The embedded MoE model: SmolLM2-135M-Instruct sparsely upcycled into a Hugging Face `MixtralForCausalLM`.

Each decoder MLP is copied into NUM_EXPERTS experts with ~1% multiplicative noise each (so experts differ), a router
with small random weights (fixed seed) picks TOP_K of them per token, and the renormalised top-k weights sum to 1, so
the model still answers like the dense one ("The capital of France is" -> Paris). Attention, norms, embeddings (tied
lm_head), tokenizer, chat template and `max_position_embeddings` are the dense checkpoint's. Weights are fp32
safetensors in transformers 5's fused expert layout (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
[E, H, I], `mlp.gate.weight` [E, H]). Engine-agnostic: never imports SGLang; torch only when building.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from sgl_multilora.embedded import COMPLETE_MARKER, EMBEDDED_MODEL_NAME, ensure_embedded_model

NUM_EXPERTS = 4
TOP_K = 2
NOISE = 0.01  # relative std of the multiplicative noise on each expert's weights
ROUTER_STD = 0.02  # std of the router's weights
SEED = 0
EMBEDDED_MOE_NAME = f"{EMBEDDED_MODEL_NAME}-MoE-{NUM_EXPERTS}x"
# Files copied verbatim from the dense checkpoint.
_COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
_MLP = ("gate_proj", "up_proj", "down_proj")


def ensure_embedded_moe_model(out: Path | None = None, cache_dir: Path | None = None) -> Path:
    """Return the MoE checkpoint dir (`out`, default `<cache_dir>/SmolLM2-135M-Instruct-MoE-4x`, beside the dense
    model), building it from the dense embedded model if needed (seconds; deterministic for a given dense model).

    Idempotent and safe under concurrency as `ensure_embedded_model` is: built in a temp dir beside the target,
    completion marker written last, `os.replace`d into place; a target without the marker is rebuilt. Offline."""
    dense = ensure_embedded_model(cache_dir)
    target = Path(out) if out is not None else dense.parent / EMBEDDED_MOE_NAME
    if (target / COMPLETE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"sgl_multilora: upcycling {dense.name} into {target} (once) ...", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _build(dense, tmp)
        (tmp / COMPLETE_MARKER).write_text(f"{EMBEDDED_MOE_NAME} seed={SEED}\n")
        if target.exists() and not (target / COMPLETE_MARKER).is_file():
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished first (os.replace cannot overwrite a non-empty dir)
            if not (target / COMPLETE_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def moe_config(dense_config: dict) -> dict:
    """The MixtralConfig dict for the upcycled model of `dense_config` (a Llama config.json)."""
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range",
            "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "bos_token_id", "eos_token_id",
            "pad_token_id", "attention_dropout", "use_cache")
    config = {k: dense_config[k] for k in keep if k in dense_config}
    assert not dense_config.get("mlp_bias") and not dense_config.get("attention_bias"), \
        "the dense model has biases, which Mixtral has no place for"
    config.update(
        architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K, sliding_window=None, router_jitter_noise=0.0, output_router_logits=False,
        dtype="float32", torch_dtype="float32", _name_or_path=EMBEDDED_MOE_NAME,
    )
    return config


def _build(dense: Path, out_dir: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    dense_config = json.loads((dense / "config.json").read_text())
    config = moe_config(dense_config)
    weights = load_file(str(dense / "model.safetensors"))
    generator = torch.Generator().manual_seed(SEED)

    def noisy(w: torch.Tensor) -> torch.Tensor:
        return w * (1 + NOISE * torch.randn(w.shape, generator=generator))

    out: dict[str, torch.Tensor] = {}
    for key, tensor in weights.items():
        if ".mlp." not in key:
            out[key] = tensor.contiguous()
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp."
        gate, up, down = (weights[f"{prefix}{name}.weight"] for name in _MLP)
        out[f"{prefix}experts.gate_up_proj"] = torch.stack(
            [noisy(torch.cat([gate, up], dim=0)) for _ in range(NUM_EXPERTS)]).contiguous()
        out[f"{prefix}experts.down_proj"] = torch.stack([noisy(down) for _ in range(NUM_EXPERTS)]).contiguous()
        out[f"{prefix}gate.weight"] = ROUTER_STD * torch.randn(
            NUM_EXPERTS, config["hidden_size"], generator=generator)
    if config.get("tie_word_embeddings"):
        out.pop("lm_head.weight", None)
    save_file(out, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in _COPIED:
        if (dense / name).is_file():
            shutil.copyfile(dense / name, out_dir / name)
    # mkdtemp and safetensors create owner-only modes; the cache is meant to be shared read-only.
    out_dir.chmod(0o755)
    for path in out_dir.iterdir():
        path.chmod(0o644)


def main(argv: list[str] | None = None) -> None:
    """CLI: print the MoE checkpoint path (building it first if needed)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="default: beside the dense embedded model")
    parser.add_argument("--cache-dir", type=Path, default=None, help="the dense model's; default $MULTILORA_CACHE_DIR")
    args = parser.parse_args(argv)
    print(ensure_embedded_moe_model(args.out, args.cache_dir))


if __name__ == "__main__":
    main()

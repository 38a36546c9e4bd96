"""One prepared live run on a GPU machine (scripts/gpu_live.sh installs the GPU kit first), or its dry run on a CPU.

Phases, each writing its part of OUT/gpu_live.json as soon as it ends (a run cut short keeps what it finished):
env (device, versions, date) -> model (random-weight Llama of real 1B-class shapes, bf16, built on the GPU; the
tokenizer is the embedded model's) -> adapters (random PEFT LoRA adapters of mixed ranks on every projection) ->
oracle (PEFT's greedy tokens for a few prompts and adapters) -> one server per arm, one after the other: stock SGLang
(`--lora-backend triton`, our plugin off) and ours (`--radix-cache-backend multilora --lora-backend multilora`,
the unified pool), each checked against the oracle and then replaying one fixed short trace (Zipf adapter
popularity, Poisson arrivals). Dry run (`--dry-run` or GPU_LIVE_DRY_RUN=1): the same code with the embedded 135M
model, fp32, the CPU server flags, tiny sizes, and no stock arm (stock SGLang's LoRA layers need CUDA).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # after the kit's site folder, which PYTHONPATH puts first

GPU = {"hidden": 2048, "inter": 8192, "layers": 16, "heads": 32, "kv_heads": 8, "adapters": 16, "ranks": (8, 16, 32, 64),
       "prompts": 3, "oracle_adapters": 3, "new_tokens": 8, "requests": 160, "rate": 16.0, "prompt_len": (64, 384),
       "output_len": 32, "zipf": 1.1}
DRY = {"adapters": 3, "ranks": (8, 16), "prompts": 2, "oracle_adapters": 1, "new_tokens": 4, "requests": 6,
       "rate": 50.0, "prompt_len": (8, 24), "output_len": 4, "zipf": 1.1}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,")


class Report:
    """OUT/gpu_live.json, rewritten whole after every phase."""

    def __init__(self, out: Path):
        self.path = out / "gpu_live.json"
        self.data: dict = {"phases": {}, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def phase(self, name: str, value) -> None:
        self.data["phases"][name] = value
        self.path.write_text(json.dumps(self.data, indent=1, default=str))


def env_info(dry: bool) -> dict:
    import importlib.metadata as md

    versions = {}
    for name in ("torch", "triton", "transformers", "peft", "sglang", "sgl-multilora"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"
    return {"dry_run": dry, "device": device, "python": platform.python_version(), "versions": versions,
            "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def build_model(work: Path, tokenizer_dir: Path, dry: bool) -> Path:
    """GPU: a random-weight LlamaForCausalLM of 1B-class shapes, bf16, saved to work/model with the tokenizer.
    Dry run: the embedded model's own directory."""
    if dry:
        return tokenizer_dir
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    config = LlamaConfig(vocab_size=vocab, hidden_size=GPU["hidden"], intermediate_size=GPU["inter"],
                         num_hidden_layers=GPU["layers"], num_attention_heads=GPU["heads"],
                         num_key_value_heads=GPU["kv_heads"], max_position_embeddings=4096, rope_theta=500000.0,
                         initializer_range=0.05, tie_word_embeddings=False, torch_dtype="bfloat16",
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    path = work / "model"
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, path / name)
    del model
    torch.cuda.empty_cache()
    return path


def build_adapters(work: Path, model_dir: Path, sizes: dict) -> list[dict]:
    """Random PEFT LoRA adapters (A, B non-zero, small) on every projection of every layer, ranks cycling over
    sizes["ranks"]; written in PEFT's file layout, so both SGLang and PEFT load them."""
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    kinds = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
    adapters = []
    for index in range(sizes["adapters"]):
        rank = sizes["ranks"][index % len(sizes["ranks"])]
        gen = torch.Generator().manual_seed(1000 + index)
        tensors = {}
        for layer in range(config["num_hidden_layers"]):
            for module, (fan_in, fan_out) in shapes.items():
                prefix = f"base_model.model.model.layers.{layer}.{kinds.get(module, 'mlp')}.{module}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * (0.5 / rank ** 0.5)
        path = work / "adapters" / f"a{index}"
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.to(torch.bfloat16 if torch.cuda.is_available() else torch.float32).contiguous()
                   for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank, "lora_dropout": 0.0,
            "target_modules": list(TARGETS), "bias": "none", "base_model_name_or_path": str(model_dir)}))
        adapters.append({"name": f"a{index}", "path": str(path), "rank": rank})
    return adapters


def prompt_ids(tokenizer_dir: Path, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return [tokenizer(p)["input_ids"] for p in PROMPTS[:count]]


def oracle(model_dir: Path, adapters: list[dict], prompts: list[list[int]], new_tokens: int) -> dict:
    """PEFT's greedy tokens: {adapter name: [token ids per prompt]}; frees the device afterwards."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    model = PeftModel.from_pretrained(base, adapters[0]["path"], adapter_name=adapters[0]["name"])
    for adapter in adapters[1:]:
        model.load_adapter(adapter["path"], adapter_name=adapter["name"])
    expected = {}
    with torch.no_grad():
        for adapter in adapters:
            model.set_adapter(adapter["name"])
            rows = []
            for ids in prompts:
                out = model.generate(torch.tensor([ids], device=device), max_new_tokens=new_tokens, do_sample=False)
                rows.append(out[0, len(ids):].tolist())
            expected[adapter["name"]] = rows
    del model, base
    if device == "cuda":
        torch.cuda.empty_cache()
    return expected


from gpu_live_arms import run_arm  # noqa: E402  (the server side: arms, flags, replay)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", default=os.environ.get("GPU_LIVE_DRY_RUN") == "1")
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu_live_work"))
    parser.add_argument("--tokenizer", type=Path, default=os.environ.get("SGL_KIT_TOKENIZER"))
    parser.add_argument("--arm-timeout", type=float, default=200.0)
    args = parser.parse_args()
    torch.manual_seed(0)
    random.seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    report, sizes = Report(args.out), (DRY if args.dry_run else GPU)
    report.phase("env", env_info(args.dry_run))
    if args.dry_run:
        torch.set_num_threads(1)
        from sgl_multilora.embedded import ensure_embedded_model

        args.tokenizer = ensure_embedded_model()
    started = time.monotonic()
    model_dir = build_model(args.work, Path(args.tokenizer), args.dry_run)
    report.phase("model", {"path": str(model_dir), "seconds": round(time.monotonic() - started, 1),
                           "config": json.loads((model_dir / "config.json").read_text())})
    adapters = build_adapters(args.work, model_dir, sizes)
    report.phase("adapters", {"num": len(adapters), "ranks": [a["rank"] for a in adapters]})
    prompts = prompt_ids(model_dir, sizes["prompts"])
    expected = oracle(model_dir, adapters[:sizes["oracle_adapters"]], prompts, sizes["new_tokens"])
    report.phase("oracle", {"prompts": prompts, "expected": expected})
    arms = ("ours",) if args.dry_run else ("stock", "ours")
    for arm in arms:
        try:
            result = asyncio.run(run_arm(arm, model_dir, adapters, prompts, expected, sizes, args.dry_run,
                                         args.out, args.arm_timeout))
        except Exception as e:  # one arm failing must not lose the other's numbers
            result = {"error": f"{type(e).__name__}: {e}"[:4000]}
        report.phase(f"arm_{arm}", result)
    report.data["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    report.phase("done", {"arms": list(arms)})
    print(json.dumps({k: v for k, v in report.data["phases"].items() if k.startswith("arm_")}, default=str)[:3000])


if __name__ == "__main__":
    main()

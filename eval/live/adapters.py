"""The load benchmarks' adapters: seeded random PEFT adapters for a workload on the embedded model, and their sizes.

Lives here: `workload_from_args` (the embedded model and the workload that a benchmark's --workload, --num-adapters,
--ranks, --param and --seed name), `make_adapters` (random PEFT adapters with the workload's names, ranks and target
modules, cached under CACHE) and the embedded model's sizes (`ELEMS_PER_RANK`, `NUM_LAYERS`, `SLOT_BYTES`). Not here:
the servers that load them (arms.py) or sending requests (driver.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm import tqdm

from eval.workloads import create_workload

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "unified_memory_adapters"
# SmolLM2-135M, fp32: per layer and rank, A and B elements of each projection (in + out)
ELEMS_PER_RANK = {"q_proj": 576 + 576, "k_proj": 576 + 192, "v_proj": 576 + 192, "o_proj": 576 + 576,
                  "gate_proj": 576 + 1536, "up_proj": 576 + 1536, "down_proj": 1536 + 576}
NUM_LAYERS, SLOT_BYTES = 30, 46080  # a slot: one token's K and V over 30 layers, 3 KV heads x 64, fp32


def make_adapters(model_path: str, workload, out_dir: Path) -> Path:
    """Random PEFT adapters (seeded per name) with the workload's names, ranks and target modules; reused when
    present."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    todo = [a for a in workload.adapters if not (out_dir / a.name / "adapter_model.safetensors").exists()]
    if not todo:
        return out_dir
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    for i, a in enumerate(tqdm(todo, desc="random adapters")):
        torch.manual_seed(1000 + i)
        config = LoraConfig(r=a.rank, lora_alpha=2 * a.rank, init_lora_weights=False, task_type="CAUSAL_LM",
                            target_modules=list(a.target_modules))
        model = get_peft_model(base, config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(0.5)
        model.save_pretrained(str(out_dir / a.name))
        base = model.unload()
    return out_dir


def workload_from_args(args: argparse.Namespace) -> tuple[str, object, tuple[int, ...], dict]:
    """The embedded model's path and the workload that --workload, --num-adapters, --ranks, --param and --seed
    name, with its ranks and parameters."""
    from sgl_multilora.embedded import ensure_embedded_model

    model = str(ensure_embedded_model())
    ranks = tuple(int(r) for r in args.ranks.split(","))
    params = {"num_adapters": args.num_adapters, "ranks": ranks}
    for item in args.param:
        key, value = item.split("=", 1)
        params[key] = json.loads(value)
    return model, create_workload(args.workload, seed=args.seed, **params), ranks, params

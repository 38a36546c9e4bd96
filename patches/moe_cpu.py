"""MoE models on SGLang's `--model-impl transformers` path on a CPU: Hugging Face's own experts module runs.

Stock SGLang 0.5.23 (`MoEMixin.recursive_replace`) swaps every HF `experts` module for a `TransformersFusedMoE`
(SGLang's `FusedMoE`), and then materialises the parameters still on the meta device (the router's) with
`get_device()`, which raises on a CPU unless `SGLANG_USE_CPU_ENGINE=1` (whose `FusedMoE` CPU path needs the
sgl-kernel CPU ops). So on a CPU a transformers-path MoE model never starts. This hook keeps HF's MoE block whole
there (router, experts module with its fused `gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I] parameters, HF's
forward), so the model computes exactly what HF transformers computes, and `lora_experts.py` can wrap the experts.
SGLang's weight loader fills those parameters by name (a checkpoint in transformers 5's fused layout). MoE
bookkeeping SGLang reads elsewhere (`moe_layers`, expert counts) is set as for a model without fused MoE layers
(no EPLB, no expert-distribution recording). Elsewhere (a GPU) SGLang's own replacement runs unchanged.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


def on_cpu() -> bool:
    """The server runs on a CPU (`--device cpu`); without server args (a bare process), when there is no GPU."""
    try:
        from sglang.srt.runtime_context import get_server_args

        device = get_server_args().device
    except Exception:  # no server args in this process (a test building a model by hand)
        device = None
    if device:
        return str(device).startswith("cpu")
    return not torch.cuda.is_available()


def _getattr_first(obj, names, default=None):
    return next((getattr(obj, n) for n in names if getattr(obj, n, None) is not None), default)


def is_hf_experts(module: nn.Module) -> bool:
    """An HF fused-experts module (transformers 5): 3-D `gate_up_proj` and `down_proj` parameters."""
    params = dict(module.named_parameters(recurse=False))
    return all(name in params and params[name].ndim == 3 for name in ("gate_up_proj", "down_proj"))


def _materialise(module: nn.Module, device: torch.device) -> int:
    """Replaces every meta-device parameter under `module` by an uninitialised one on `device` (the weight loader
    fills it); returns how many."""
    count = 0
    for sub in module.modules():
        for name, param in list(sub.named_parameters(recurse=False)):
            if param.device.type == "meta":
                setattr(sub, name, nn.Parameter(torch.empty_like(param, device=device), requires_grad=False))
                count += 1
    return count


def keep_hf_moe_blocks(model) -> list[str]:
    """Sets `model`'s (a `TransformersBase` with `MoEMixin`) MoE bookkeeping for HF-run MoE blocks and puts every
    MoE block's parameters (router and experts) on the CPU. Returns the MoE blocks' qualified names."""
    text_config = model.text_config
    num_experts = _getattr_first(text_config, ("num_local_experts", "num_experts", "n_routed_experts"))
    assert num_experts is not None, "Cannot determine num_experts from config."
    model.mlp_moe_layers, model.moe_layers, model.num_moe_layers = [], [], 0
    model.num_logical_experts = model.num_physical_experts = model.num_local_physical_experts = num_experts
    model.num_shared_experts = _getattr_first(text_config, ("n_shared_experts", "moe_num_shared_experts"), 0)
    model.num_redundant_experts = 0
    blocks = []
    for name, module in model.model.named_modules():
        experts = getattr(module, "experts", None)
        if isinstance(experts, nn.Module) and (is_hf_experts(experts) or isinstance(experts, nn.ModuleList)):
            _materialise(module, torch.device("cpu"))
            blocks.append(f"model.{name}")
    return blocks


# ---- hooks (see hook_table.py) -------------------------------------------------------------------------------


def recursive_replace(original, self):
    """AROUND `MoEMixin.recursive_replace`: on a CPU, HF's MoE blocks stay (see the module docstring) and only the
    base class's Linear / RMSNorm replacement runs; elsewhere SGLang's own replacement."""
    if not on_cpu():
        return original(self)
    from sglang.srt.models.transformers import TransformersBase

    TransformersBase.recursive_replace(self)  # Linear / RMSNorm; the MoE blocks' routers are not nn.Linear
    blocks = keep_hf_moe_blocks(self)
    logger.info("sgl_multilora: %d MoE blocks run Hugging Face's experts module on the CPU (SGLang's FusedMoE "
                "needs GPU or sgl-kernel CPU kernels)", len(blocks))
    return None

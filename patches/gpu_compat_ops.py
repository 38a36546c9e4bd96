"""Plain-torch versions of the CUDA ops SGLang's Llama text path calls from sgl_kernel and its JIT kernels.

Lives here: the op bodies that `gpu_compat.py` installs (as the `sgl_kernel` stub's attributes and over SGLang's JIT
launchers) on a CUDA machine without sgl_kernel. Not here: deciding when they are installed (gpu_compat.py). Each op
keeps the signature and in-place contract of the op it stands in for; math is done in fp32 and cast back, as the CUDA
kernels do. Pure torch: runs on any device (the tests run them on CPU against plain-math references).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _rms(x32: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)


def rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None,
            enable_pdl: bool | None = None) -> torch.Tensor:
    """Semantics: out = x / sqrt(mean(x^2) + eps) * w (fp32 math). input [..., d], weight [d]; `out` written if
    given, else a new tensor of input's dtype."""
    x32 = input.float()
    result = (x32 * _rms(x32, eps) * weight.float()).to(input.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


def fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                      enable_pdl: bool | None = None, *, cast_x_before_out_mul: bool = False) -> None:
    """Semantics (in place): residual <- input + residual; input <- rmsnorm(residual) * w. With
    `cast_x_before_out_mul` (HF semantics) the normalised value is cast to input's dtype before the weight multiply."""
    summed = input.float() + residual.float()
    residual.copy_(summed.to(residual.dtype))
    normed = summed * _rms(summed, eps)
    if cast_x_before_out_mul:
        input.copy_(weight * normed.to(input.dtype))
    else:
        input.copy_((normed * weight.float()).to(input.dtype))


def rmsnorm_hf(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Semantics: out = w * cast(x / sqrt(mean(x^2) + eps)) (HF LlamaRMSNorm: cast before the weight multiply)."""
    x32 = input.float()
    result = weight * (x32 * _rms(x32, eps)).to(input.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


def gemma_rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None,
                  enable_pdl: bool | None = None) -> torch.Tensor:
    """Semantics: out = x / sqrt(mean(x^2) + eps) * (1 + w)."""
    return rmsnorm(input, weight.float() + 1.0, eps, out)


def gemma_fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                            enable_pdl: bool | None = None) -> None:
    """Semantics (in place): residual <- input + residual; input <- rmsnorm(residual) * (1 + w)."""
    fused_add_rmsnorm(input, residual, weight.float() + 1.0, eps)


def _act_and_mul(act, input: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    d = input.shape[-1] // 2
    x32 = input.float()
    result = (act(x32[..., :d]) * x32[..., d:]).to(input.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


def silu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None, *args, **kwargs) -> torch.Tensor:
    """Semantics: out = silu(x[..., :d]) * x[..., d:], input [..., 2d] -> out [..., d] (written if given). Extra
    arguments of SGLang's JIT variant (expert ids for MoE) are not supported: they raise."""
    if args or any(v is not None for v in kwargs.values()):
        raise NotImplementedError("gpu_compat: silu_and_mul with MoE expert arguments needs sgl_kernel / JIT")
    return _act_and_mul(F.silu, input, out)


def gelu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None, *args, **kwargs) -> torch.Tensor:
    """Semantics: out = gelu_erf(x[..., :d]) * x[..., d:]."""
    return _act_and_mul(F.gelu, input, out)


def gelu_tanh_and_mul(input: torch.Tensor, out: torch.Tensor | None = None, *args, **kwargs) -> torch.Tensor:
    """Semantics: out = gelu_tanh(x[..., :d]) * x[..., d:]."""
    return _act_and_mul(lambda x: F.gelu(x, approximate="tanh"), input, out)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """x [tokens, heads, rot_dim] fp32; cos, sin [tokens, 1, rot_dim / 2]."""
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def _rope_inplace(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, head_size: int,
                  is_neox: bool) -> None:
    num_tokens = positions.shape[0]
    rot_dim = cos_sin_cache.shape[-1]
    heads = x.view(num_tokens, -1, head_size)
    cos, sin = cos_sin_cache.index_select(0, positions.long()).float().chunk(2, dim=-1)
    rot = heads[..., :rot_dim]
    rot.copy_(_rope(rot.float(), cos.unsqueeze(1), sin.unsqueeze(1), is_neox).to(x.dtype))


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None, head_size: int,
                     cos_sin_cache: torch.Tensor, is_neox: bool = True) -> None:
    """Semantics (in place, vLLM / sgl_kernel layout): for each token t and head h, the first rot_dim entries of
    q[t, h] and k[t, h] are rotated by angle table cos_sin_cache[positions[t]] = [cos | sin] (rot_dim / 2 each).
    query [tokens, heads * head_size] or [tokens, heads, head_size]; key likewise or None; must be contiguous views."""
    _rope_inplace(query, positions, cos_sin_cache, head_size, is_neox)
    if key is not None:
        _rope_inplace(key, positions, cos_sin_cache, head_size, is_neox)


def apply_rope_with_cos_sin_cache_inplace(q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                                          positions: torch.Tensor, *, is_neox: bool, rope_dim: int = 0,
                                          fused_args=None) -> None:
    """Semantics: as `rotary_embedding`, on q [tokens, q_heads, rot_dim] and k [tokens, kv_heads, rot_dim] (possibly
    strided slices of the heads, written in place). The fused KV-cache store (`fused_args`) is not supported here
    (gpu_compat turns it off at its source, `enable_fused_set_kv_buffer`); it raises."""
    if fused_args is not None:
        raise NotImplementedError("gpu_compat: fused RoPE + KV store needs SGLang's JIT kernels")
    cache = cos_sin_cache if not rope_dim else cos_sin_cache[:, :rope_dim]
    cos, sin = cache.index_select(0, positions.long()).float().chunk(2, dim=-1)
    for x in (q, k):
        x.copy_(_rope(x.float(), cos.unsqueeze(1), sin.unsqueeze(1), is_neox).to(x.dtype))


def _as_column(value, probs: torch.Tensor) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(probs.device).view(-1, 1)
    return torch.full((probs.shape[0], 1), value, device=probs.device)


def top_k_renorm_prob(probs: torch.Tensor, top_k, *args, **kwargs) -> torch.Tensor:
    """Semantics: per row, keep the probabilities >= the row's k-th largest (ties kept), zero the rest, renormalise.
    probs [batch, vocab] fp32; top_k an int or [batch] ints (k >= vocab keeps the row)."""
    k = _as_column(top_k, probs).long().clamp(1, probs.shape[-1])
    kth = probs.sort(dim=-1, descending=True).values.gather(-1, k - 1)
    kept = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


def top_p_renorm_prob(probs: torch.Tensor, top_p, *args, **kwargs) -> torch.Tensor:
    """Semantics: per row, keep the smallest set of largest probabilities whose sum reaches p (the token that
    crosses p is kept), zero the rest, renormalise. probs [batch, vocab] fp32; top_p a float or [batch] floats."""
    p = _as_column(top_p, probs).float()
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each sorted entry
    keep_sorted = before < p
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


def is_arch_support_pdl(*args, **kwargs) -> bool:
    """Programmatic dependent launch is a property of sgl_kernel's CUDA kernels; the torch ops never use it."""
    return False


STUB_OPS = {
    "rmsnorm": rmsnorm, "fused_add_rmsnorm": fused_add_rmsnorm, "gemma_rmsnorm": gemma_rmsnorm,
    "gemma_fused_add_rmsnorm": gemma_fused_add_rmsnorm, "silu_and_mul": silu_and_mul, "gelu_and_mul": gelu_and_mul,
    "gelu_tanh_and_mul": gelu_tanh_and_mul, "rotary_embedding": rotary_embedding,
    "top_k_renorm_prob": top_k_renorm_prob, "top_p_renorm_prob": top_p_renorm_prob,
    "is_arch_support_pdl": is_arch_support_pdl,
}
"""`sgl_kernel.<name>` (any submodule, e.g. `sgl_kernel.utils.is_arch_support_pdl`) -> the torch op serving it."""

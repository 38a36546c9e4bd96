"""patches/gpu_compat.py and its ops (gpu_compat_ops.py): each torch op against a plain-math reference on CPU tensors
(fp32 exact-ish, bf16 within bf16 tolerance), then the stub `sgl_kernel` package and the post-import patches, forced on
(MULTILORA_GPU_COMPAT=1) since this machine has no CUDA."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from sgl_multilora.patches import gpu_compat_ops as ops

torch.set_num_threads(1)
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def rms_ref(x, w, eps):
    rows = []
    for row in x.double().reshape(-1, x.shape[-1]):
        scale = 1.0 / math.sqrt(sum(v * v for v in row.tolist()) / len(row) + eps)
        rows.append([v * scale * float(wv) for v, wv in zip(row.tolist(), w.double().tolist())])
    return torch.tensor(rows, dtype=torch.float64).reshape(x.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_and_fused_add(dtype):
    gen = torch.Generator().manual_seed(0)
    x, res = torch.randn(5, 64, generator=gen).to(dtype), torch.randn(5, 64, generator=gen).to(dtype)
    w = torch.randn(64, generator=gen).to(dtype)
    torch.testing.assert_close(ops.rmsnorm(x, w, 1e-6).double(), rms_ref(x, w, 1e-6), **TOL[dtype])
    out = torch.empty_like(x)
    assert ops.rmsnorm(x, w, 1e-6, out=out) is out
    torch.testing.assert_close(ops.gemma_rmsnorm(x, w, 1e-6).double(), rms_ref(x, w.float() + 1, 1e-6), **TOL[dtype])
    summed = x.double() + res.double()
    x2, r2 = x.clone(), res.clone()
    assert ops.fused_add_rmsnorm(x2, r2, w, 1e-6) is None  # in place
    torch.testing.assert_close(r2.double(), summed, **TOL[dtype])
    torch.testing.assert_close(x2.double(), rms_ref(summed, w, 1e-6), **TOL[dtype])
    x3, r3 = x.clone(), res.clone()
    ops.fused_add_rmsnorm(x3, r3, w, 1e-6, cast_x_before_out_mul=True)
    torch.testing.assert_close(x3.double(), rms_ref(summed, w, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("name, act", [("silu_and_mul", lambda v: v / (1 + math.exp(-v))),
                                       ("gelu_and_mul", lambda v: 0.5 * v * (1 + math.erf(v / math.sqrt(2)))),
                                       ("gelu_tanh_and_mul", lambda v: 0.5 * v * (1 + math.tanh(
                                           math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3))))])
def test_act_and_mul(name, act):
    x = torch.randn(3, 2 * 16, generator=torch.Generator().manual_seed(1))
    ref = torch.tensor([[act(a) * b for a, b in zip(row[:16].tolist(), row[16:].tolist())] for row in x])
    torch.testing.assert_close(getattr(ops, name)(x), ref, **TOL[torch.float32])
    out = torch.empty(3, 16)
    getattr(ops, name)(x, out)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def rope_ref(vec, pos, rot_dim, is_neox, base=10000.0):
    """One head's vector rotated by plain trigonometry (pair (i, i + d/2) for NeoX, (2i, 2i + 1) for GPT-J)."""
    out = list(vec)
    for i in range(rot_dim // 2):
        angle = pos * base ** (-2 * i / rot_dim)
        a, b = (i, i + rot_dim // 2) if is_neox else (2 * i, 2 * i + 1)
        out[a] = vec[a] * math.cos(angle) - vec[b] * math.sin(angle)
        out[b] = vec[b] * math.cos(angle) + vec[a] * math.sin(angle)
    return out


def cos_sin_cache(max_pos, rot_dim, base=10000.0):
    inv = base ** (-torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    freqs = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).float()


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim", [16, 8])  # 8 < head size: partial rotary
def test_rotary_embedding(is_neox, rot_dim):
    gen = torch.Generator().manual_seed(2)
    head, heads, kv_heads = 16, 3, 1
    positions = torch.tensor([0, 5, 17])
    q, k = torch.randn(3, heads * head, generator=gen), torch.randn(3, kv_heads * head, generator=gen)
    cache = cos_sin_cache(32, rot_dim)
    want_q = [[v for h in range(heads) for v in rope_ref(q[t].view(heads, head)[h].tolist(), int(positions[t]),
                                                             rot_dim, is_neox)] for t in range(3)]
    want_k = [[v for h in range(kv_heads) for v in rope_ref(k[t].view(kv_heads, head)[h].tolist(),
                                                               int(positions[t]), rot_dim, is_neox)] for t in range(3)]
    q1, k1 = q.clone(), k.clone()
    ops.rotary_embedding(positions, q1, k1, head, cache, is_neox)
    torch.testing.assert_close(q1, torch.tensor(want_q), **TOL[torch.float32])
    torch.testing.assert_close(k1, torch.tensor(want_k), **TOL[torch.float32])
    q2, k2 = q.clone().view(3, heads, head), k.clone().view(3, kv_heads, head)
    ops.apply_rope_with_cos_sin_cache_inplace(positions=positions, q=q2[..., :rot_dim], k=k2[..., :rot_dim],
                                              cos_sin_cache=cache, is_neox=is_neox, fused_args=None)
    torch.testing.assert_close(q2.reshape(3, -1), torch.tensor(want_q), **TOL[torch.float32])
    torch.testing.assert_close(k2.reshape(3, -1), torch.tensor(want_k), **TOL[torch.float32])


def test_top_k_and_top_p_renorm():
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.25, 0.25, 0.25, 0.25]])
    torch.testing.assert_close(ops.top_k_renorm_prob(probs, torch.tensor([2, 4])),
                               torch.tensor([[0.0, 4 / 7, 0.0, 3 / 7], [0.25, 0.25, 0.25, 0.25]]))
    # 0.4 < 0.5, 0.4 + 0.3 reaches it: keep {0.4, 0.3}; p = 0.2 keeps only the largest
    torch.testing.assert_close(ops.top_p_renorm_prob(probs[:1], 0.5), torch.tensor([[0.0, 4 / 7, 0.0, 3 / 7]]))
    torch.testing.assert_close(ops.top_p_renorm_prob(probs[:1], torch.tensor([0.2])), torch.tensor([[0.0, 1, 0, 0.0]]))


STUB_SCRIPT = """
import sys, torch
from sgl_multilora.patches import gpu_compat
gpu_compat.install()
import sgl_kernel
from sgl_kernel import rmsnorm, fused_add_rmsnorm, silu_and_mul
from sgl_kernel.utils import is_arch_support_pdl
from sgl_kernel.kvcacheio import transfer_kv_direct
from sgl_multilora.patches import gpu_compat_ops as ops
assert rmsnorm is ops.rmsnorm and silu_and_mul is ops.silu_and_mul and is_arch_support_pdl() is False
try:
    transfer_kv_direct(None)
    raise SystemExit("a missing op did not raise")
except NotImplementedError as e:
    assert "sgl_kernel.kvcacheio.transfer_kv_direct" in str(e), e
import sglang.kernels.ops.kvcache.kvcache as kv, sglang.srt.models.utils as mu, sglang.kernels.ops.attention.rope as rope
assert kv.can_use_store_cache(128) is False and mu.enable_fused_set_kv_buffer(None) is False
assert rope.apply_rope_with_cos_sin_cache_inplace is ops.apply_rope_with_cos_sin_cache_inplace
import os
assert os.environ["SGLANG_FORCE_FUSED_OP_BACKEND"] == "torch"
print("stub ok")
"""


def test_stub_package_and_post_import_patches():
    """In a fresh process (the finder and the patched modules stay process-wide)."""
    env = {**__import__("os").environ, "MULTILORA_GPU_COMPAT": "1", "OMP_NUM_THREADS": "1"}
    env.pop("SGLANG_FORCE_FUSED_OP_BACKEND", None)
    result = subprocess.run([sys.executable, "-c", STUB_SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0 and "stub ok" in result.stdout, result.stderr[-3000:]


def test_inactive_without_cuda():
    """auto mode on a CPU machine: no stub (sgl_kernel stays missing)."""
    code = ("from sgl_multilora.patches import gpu_compat; gpu_compat.install(); import importlib.util, torch; "
            "assert not gpu_compat.active(); assert importlib.util.find_spec('sgl_kernel') is None; print('off')")
    env = {**__import__("os").environ, "MULTILORA_GPU_COMPAT": "auto"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0 and "off" in result.stdout, result.stderr[-2000:]

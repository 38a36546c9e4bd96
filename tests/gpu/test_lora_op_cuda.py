"""The segmented LoRA op on a GPU (bf16 / fp16 against an fp32 CPU computation). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from sgl_multilora.segments import SegmentMeta
from sgl_multilora.triton_kernels.lora_ref import lora_shrink_expand_ref

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype, tol", [(torch.float16, 2e-2), (torch.bfloat16, 5e-2)])
def test_lora_op_on_cuda_matches_fp32(dtype, tol):
    g = torch.Generator().manual_seed(0)
    meta = SegmentMeta.build(["A", None, "B", "A"], [64, 7, 33, 1], device="cuda")
    ranks = {"A": 16, "B": 64}
    weights = {k: (torch.randn(r, 4096, generator=g) / 64, torch.randn(1024, r, generator=g) / 8) for k, r in ranks.items()}
    x = torch.randn(meta.num_tokens, 4096, generator=g)
    y32 = torch.zeros(meta.num_tokens, 1024)
    args = lambda dev, dt: (  # noqa: E731
        [grp.token_index.to(dev) for grp in meta.groups],
        [weights[grp.key][0].to(dev, dt) for grp in meta.groups],
        [weights[grp.key][1].to(dev, dt) for grp in meta.groups],
        [0.5 for _ in meta.groups],
    )
    lora_shrink_expand_ref(x, y32, *args("cpu", torch.float32))
    y = torch.zeros(meta.num_tokens, 1024, device="cuda", dtype=dtype)
    lora_shrink_expand_ref(x.to("cuda", dtype), y, *args("cuda", dtype))
    torch.testing.assert_close(y.float().cpu(), y32, atol=tol, rtol=tol)

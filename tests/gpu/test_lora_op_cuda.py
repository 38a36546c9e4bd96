"""The LoRA op on a GPU over a step laid out from requests (bf16 / fp16, torch reference and Triton)
against the same op in fp32 on CPU. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from sgl_multilora.segments import SegmentMeta
from sgl_multilora.triton_kernels.ops import lora_forward
from sgl_multilora.triton_kernels.weights import LoRAWeights

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype, tol", [(torch.float16, 2e-2), (torch.bfloat16, 5e-2)])
def test_lora_op_on_cuda_matches_fp32(impl, dtype, tol):
    g = torch.Generator().manual_seed(0)
    adapters, lens = ["A", None, "B", "A"], [64, 7, 33, 1]
    ranks = {"A": 16, "B": 64}
    lora = {k: (torch.randn(r, 4096, generator=g) / 64, torch.randn(1024, r, generator=g) / 8)
            for k, r in ranks.items()}
    x = torch.randn(sum(lens), 4096, generator=g)

    def run(device: str, dt: torch.dtype) -> torch.Tensor:
        meta = SegmentMeta.make(128, 2, device)
        meta.prepare_requests(adapters, lens)
        weights = LoRAWeights.from_list([lora[k][0].to(device, dt) for k in meta.keys],
                                        [lora[k][1].to(device, dt) for k in meta.keys],
                                        [0.5] * len(meta.keys), (0, 1024))
        y = torch.zeros(meta.num_tokens, 1024, device=device, dtype=dt)
        op = impl if device == "cuda" else "torch"
        return lora_forward(x.to(device, dt), y, meta, weights, impl=op)

    expected = run("cpu", torch.float32)
    torch.testing.assert_close(run("cuda", dtype).float().cpu(), expected, atol=tol, rtol=tol)

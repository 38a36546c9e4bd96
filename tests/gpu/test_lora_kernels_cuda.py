"""The compiled Triton LoRA kernels on a GPU: bf16 / fp16 against float64 torch math, and CUDA-graph replay with
the adapter set changing between capture and replay (the failure of SGLang issue #28371). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from sgl_multilora.segments import NO_ADAPTER, SegmentMeta
from sgl_multilora.triton_kernels.ops import lora_forward, shrink_buffer
from sgl_multilora.triton_kernels.weights import LoRAWeights
from tests.kernels.oracle import Problem, expected_output, make_problem

pytestmark = pytest.mark.gpu

TOL = {torch.float16: 2e-2, torch.bfloat16: 6e-2}


def _to_cuda(p):
    p.x, p.y0, p.token_slot = p.x.cuda(), p.y0.cuda(), p.token_slot.cuda()
    p.lora_a = [None if a is None else a.cuda() for a in p.lora_a]
    p.lora_b = [None if b is None else b.cuda() for b in p.lora_b]
    return p


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("num_tokens, popularity", [(1, "identical"), (64, "distinct"), (256, "zipf:1.5"),
                                                    (2048, "uniform")])
def test_llama3_8b_qkv_on_cuda(dtype, num_tokens, popularity):
    p = _to_cuda(make_problem(num_tokens=num_tokens, in_features=4096, slice_widths=[4096, 1024, 1024],
                              ranks=[16, 64, 16, 64, 16, 64, 16, 64], popularity=popularity, dtype=dtype))
    weights = LoRAWeights.from_list(p.lora_a, p.lora_b, p.scalings, p.slice_offsets)
    y = p.y0.clone()
    lora_forward(p.x, y, SegmentMeta.build(p.token_slot, 8), weights, impl="triton")
    torch.testing.assert_close(y.double().cpu(), expected_output(_cpu(p)), atol=TOL[dtype], rtol=TOL[dtype])


def _cpu(p):
    return Problem(
        x=p.x.cpu(), y0=p.y0.cpu(), token_slot=p.token_slot.cpu(),
        lora_a=[None if a is None else a.cpu() for a in p.lora_a],
        lora_b=[None if b is None else b.cpu() for b in p.lora_b],
        scalings=p.scalings, slice_offsets=p.slice_offsets,
    )


def test_cuda_graph_replay_with_a_different_adapter_set():
    """Capture with adapters {0, 1} on the batch, replay with {2, 3} and with base-only tokens: the fixed layout
    buffers, weight tables and grid stay; only their contents change."""
    dtype, n, slots = torch.bfloat16, 32, 4
    p = _to_cuda(make_problem(num_tokens=n, in_features=1024, slice_widths=[1024, 256, 256],
                              ranks=[16, 64, 8, 32], popularity="uniform", dtype=dtype))
    weights = LoRAWeights.from_list(p.lora_a, p.lora_b, p.scalings, p.slice_offsets)
    meta = SegmentMeta.make(n, slots, "cuda")
    x, y, t = p.x.clone(), p.y0.clone(), shrink_buffer(n, weights, torch.device("cuda"))
    token_slot = torch.full((n,), NO_ADAPTER, dtype=torch.int32, device="cuda")

    def step():
        y.copy_(p.y0)
        lora_forward(x, y, meta, weights, impl="triton", t=t)

    token_slot.copy_(torch.tensor([0, 1] * (n // 2), dtype=torch.int32))
    meta.prepare(token_slot)
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for slots_now in ([2, 3] * (n // 2), [-1] * n, [3, -1, 0, 2] * (n // 4)):
        token_slot.copy_(torch.tensor(slots_now, dtype=torch.int32))
        meta.prepare(token_slot)  # refilled in place on the device, outside the graph
        graph.replay()
        torch.cuda.synchronize()
        p.token_slot = token_slot.clone()
        expected = expected_output(_cpu(p))
        torch.testing.assert_close(y.double().cpu(), expected, atol=TOL[dtype], rtol=TOL[dtype])


def _in_kv_buffer(kv: torch.Tensor, tensors: list[torch.Tensor | None], start: int) -> list[torch.Tensor | None]:
    """Copies `tensors` into consecutive areas of one flat KV-shaped buffer from element `start` on (as the unified
    pool places an adapter's matrices in its slots) and returns those views."""
    flat, out = kv.view(-1), []
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        view = flat[start:start + t.numel()].view(t.shape)
        view.copy_(t)
        out.append(view)
        start += t.numel() + 64  # areas need not be adjacent
    return out


def test_cuda_graph_replay_reads_pool_views_through_tables_refilled_in_place():
    """What `--lora-backend multilora` does with the unified pool: weights are views of the KV buffer, the kernels
    read them through device tables that keep their addresses; a new binding (other adapters, other places in
    the buffer, other ranks, an empty slot) refills the tables in place and a graph captured before replays it."""
    dtype, n, slots = torch.bfloat16, 32, 4
    kv = torch.zeros(4096, 2, 8, 128, dtype=dtype, device="cuda")  # 4096 slots, 2 heads x 128, one layer's K
    first = _to_cuda(make_problem(num_tokens=n, in_features=1024, slice_widths=[1024, 256, 256],
                                  ranks=[16, 64, 8, 32], popularity="uniform", dtype=dtype, seed=1))
    second = _to_cuda(make_problem(num_tokens=n, in_features=1024, slice_widths=[1024, 256, 256],
                                   ranks=[64, 8, None, 16], popularity="uniform", dtype=dtype, seed=2))

    def bind(p, start):
        a = _in_kv_buffer(kv, p.lora_a, start)
        b = _in_kv_buffer(kv, p.lora_b, start + 3_000_000)
        return LoRAWeights.from_list(a, b, p.scalings, p.slice_offsets)

    weights = bind(first, 0)
    tables = weights.tables()  # the fixed tables the graph reads
    meta = SegmentMeta.make(n, slots, "cuda")
    x, y, t = first.x.clone(), first.y0.clone(), shrink_buffer(n, weights, torch.device("cuda"))
    token_slot = torch.tensor([0, 1, 2, 3] * (n // 4), dtype=torch.int32, device="cuda")
    meta.prepare(token_slot)
    first.token_slot = token_slot.clone()

    def step():
        y.copy_(first.y0)
        lora_forward(x, y, meta, weights, impl="triton", t=t)

    step()
    torch.cuda.synchronize()
    torch.testing.assert_close(y.double().cpu(), expected_output(_cpu(first)), atol=TOL[dtype], rtol=TOL[dtype])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    rebound = bind(second, 1_000_000)
    assert rebound.max_rank == weights.max_rank
    for name, fresh in rebound.tables().items():
        tables[name].copy_(fresh)
    token_slot.copy_(torch.tensor([0, 2, 1, 3, -1, 0, 0, 3] * (n // 8), dtype=torch.int32))
    meta.prepare(token_slot)
    graph.replay()
    torch.cuda.synchronize()
    second.token_slot, second.x, second.y0 = token_slot.clone(), first.x, first.y0
    torch.testing.assert_close(y.double().cpu(), expected_output(_cpu(second)), atol=TOL[dtype], rtol=TOL[dtype])

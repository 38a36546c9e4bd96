"""The compiled Triton LoRA kernels on a GPU: bf16 / fp16 against float64 torch math, and CUDA-graph replay with
the adapter set changing between capture and replay (the failure of SGLang issue #28371). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from sgl_multilora.segments import NO_ADAPTER, SegmentMeta
from sgl_multilora.triton_kernels.ops import lora_forward, shrink_buffer
from sgl_multilora.triton_kernels.weights import LoRAWeights, TableSet
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


def test_cuda_graph_replay_reads_a_table_set_refilled_with_other_adapters():
    """What `--lora-backend multilora` does with the unified pool: each slot's weights are views of a KV buffer, and
    the kernels of every module read them through one `TableSet`, whose device tables keep their addresses. A new
    binding (other adapters at other places in the buffer, other ranks, an empty slot, a module one adapter lacks)
    refills it, and a graph captured before replays it."""
    dtype, n, slots = torch.bfloat16, 32, 4
    kv = torch.zeros(1 << 23, dtype=dtype, device="cuda")  # a flat stand-in for a layer's K rows
    shapes = {"qkv": (1024, [1024, 256, 256]), "down": (2048, [1024])}
    problems = {name: [_to_cuda(make_problem(num_tokens=n, in_features=in_f, slice_widths=widths,
                                             ranks=ranks, popularity="uniform", dtype=dtype, seed=seed))
                       for seed, ranks in ((1, [16, 64, 8, 32]), (2, [64, 8, None, 16]))]
                for name, (in_f, widths) in shapes.items()}
    at = [0]

    def place(t):
        view = kv[at[0]:at[0] + t.numel()].view(t.shape)
        view.copy_(t)
        at[0] += t.numel() + 64
        return view

    def binding(k: int):
        """Slot s -> {module: (A, B)} of problem k, copied into the buffer; module "down" left out of slot 3."""
        out = [{} for _ in range(slots)]
        for name, ps in problems.items():
            p = ps[k]
            for s in range(slots):
                if p.lora_a[s] is not None and not (name == "down" and s == 3):
                    out[s][name] = (place(p.lora_a[s]), place(p.lora_b[s]))
        return out

    ts = TableSet({name: (in_f, problems[name][0].slice_offsets) for name, (in_f, _) in shapes.items()}, slots, 64,
                  dtype, "cuda")
    meta = SegmentMeta.make(n, slots, "cuda")
    token_slot = torch.tensor([0, 1, 2, 3] * (n // 4), dtype=torch.int32, device="cuda")
    meta.prepare(token_slot)
    ys = {name: problems[name][0].y0.clone() for name in shapes}
    ts_bufs = {name: shrink_buffer(n, ts.weights(name), torch.device("cuda")) for name in shapes}

    def step():
        for name in shapes:
            ys[name].copy_(problems[name][0].y0)
            lora_forward(problems[name][0].x, ys[name], meta, ts.weights(name), impl="triton", t=ts_bufs[name])

    def check(k: int, bound, scalings):
        for name in shapes:
            p = problems[name][k]
            expect = Problem(x=problems[name][0].x.cpu(), y0=problems[name][0].y0.cpu(), token_slot=token_slot.cpu(),
                             lora_a=[None if name not in b else b[name][0].cpu() for b in bound],
                             lora_b=[None if name not in b else b[name][1].cpu() for b in bound],
                             scalings=scalings, slice_offsets=p.slice_offsets)
            torch.testing.assert_close(ys[name].double().cpu(), expected_output(expect), atol=TOL[dtype],
                                       rtol=TOL[dtype], msg=name)

    first = binding(0)
    ts.refill(first, [1.0, 0.5, 2.0, 1.5])
    step()
    torch.cuda.synchronize()
    check(0, first, [1.0, 0.5, 2.0, 1.5])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    second = binding(1)
    ts.refill(second, [0.25, 1.0, 0.0, 3.0])
    token_slot.copy_(torch.tensor([0, 2, 1, 3, -1, 0, 0, 3] * (n // 8), dtype=torch.int32))
    meta.prepare(token_slot)
    graph.replay()
    torch.cuda.synchronize()
    check(1, second, [0.25, 1.0, 0.0, 3.0])

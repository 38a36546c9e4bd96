"""The host tier's store (`patches/host_kv.HostKVStore`) alone: runs of host slots, round trips with fragmented host
slots, and, on CUDA, the ordering of its side-stream copies with kernels that overwrite the device slots right
after a spill or read them right after a load-back (the CUDA cases are skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from sgl_multilora.patches.host_kv import HostKVStore, contiguous_runs

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def test_contiguous_runs():
    assert contiguous_runs([]) == []
    assert contiguous_runs([4]) == [(0, 4, 1)]
    assert contiguous_runs([3, 4, 5, 9, 10, 2, 3]) == [(0, 3, 3), (3, 9, 2), (5, 2, 2)]


def kv(device, layers=4, slots=512, heads=2, dim=16, dtype=torch.float16):
    g = torch.Generator().manual_seed(0)
    k = [torch.randn(slots, heads, dim, generator=g).to(device, dtype) for _ in range(layers)]
    v = [torch.randn(slots, heads, dim, generator=g).to(device, dtype) for _ in range(layers)]
    return k, v


@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_through_fragmented_host_slots(device):
    k, v = kv(device)
    store = HostKVStore(k, v, capacity=96)
    first = store.alloc(40)
    store.alloc(30)
    store.free(first[5:25])  # a hole in the middle: the next allocation is two runs, not one
    third = store.alloc(26)
    assert len(contiguous_runs(third)) >= 2
    src = list(range(100, 126))
    expected_k = [b[src].clone() for b in k]
    expected_v = [b[src].clone() for b in v]
    store.write(third, src)
    for b in k + v:
        b[src] = 0  # the device slots are reused at once
    dst = list(range(300, 326))[::-1]  # any device slots, in any order
    store.read(third, dst)
    for layer in range(len(k)):
        assert torch.equal(k[layer][dst].cpu(), expected_k[layer].cpu())
        assert torch.equal(v[layer][dst].cpu(), expected_v[layer].cpu())
    assert store.num_used == 40 + 30 - 20 + 26


@pytest.mark.gpu
def test_cuda_copies_are_ordered_with_kernels_that_reuse_the_slots():
    """Many spills, each followed at once by a kernel that overwrites the spilled slots, and load-backs followed
    at once by a kernel reading the loaded slots: the side stream must see the KV as it was, and the reader the KV
    as it was written (a missing stream dependency shows as wrong values, since the copies are slower than the
    kernels that race them)."""
    layers, slots = 8, 4096
    k, v = kv("cuda", layers=layers, slots=slots, heads=8, dim=128, dtype=torch.bfloat16)
    originals = [b.clone() for b in k]
    store = HostKVStore(k, v, capacity=slots)
    n = 1024
    for round_ in range(4):
        src = torch.randperm(slots, generator=torch.Generator().manual_seed(round_))[:n].tolist()
        host = store.alloc(n)
        store.write(host, src)
        for b in k:
            b.index_fill_(0, torch.tensor(src, device="cuda"), float("nan"))  # on the current stream, at once
        store.read(host, src)
        sums = torch.stack([b[src].float().sum() for b in k])  # read right after the load-back
        expected = torch.stack([o[src].float().sum() for o in originals])
        torch.testing.assert_close(sums, expected, rtol=0, atol=0)
        store.free(host)
    torch.cuda.synchronize()
    for b, o in zip(k, originals):
        assert torch.equal(b, o)

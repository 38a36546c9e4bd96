"""`TableSet`: many modules' weight tables refilled together when batch slots are rebound to other adapters (the
unified pool under SGLang's layers), in the Triton interpreter against float64 torch math."""

from __future__ import annotations

import pytest
import torch

from sgl_multilora.segments import SegmentMeta
from sgl_multilora.triton_kernels.ops import lora_forward
from sgl_multilora.triton_kernels.weights import TableSet

MODULES = {(0, "qkv"): (32, (0, 32, 48, 64)), (0, "down"): (48, (0, 32)), (1, "qkv"): (32, (0, 32, 48, 64))}
SLOTS, R_MAX = 3, 8


def adapter(seed: int, rank: int, modules=MODULES) -> dict:
    """key -> (A, B) as views into one flat buffer (as the pool's KV rows hold them), some modules left out."""
    g = torch.Generator().manual_seed(seed)
    flat = torch.zeros(100_000)
    out, at = {}, 17
    for key in modules:
        in_f, offs = MODULES[key]
        n = len(offs) - 1
        for shape in ((n * rank, in_f), (offs[-1], rank)):
            view = flat[at:at + shape[0] * shape[1]].view(shape)
            view.copy_(torch.randn(shape, generator=g) / 4)
            out.setdefault(key, []).append(view)
            at += shape[0] * shape[1] + 5
    return {k: tuple(v) for k, v in out.items()}


def expected(x, y0, key, slot_of_token, slots, scalings):
    in_f, offs = MODULES[key]
    y = y0.double().clone()
    for i, s in enumerate(slot_of_token):
        if s < 0 or slots[s] is None or key not in slots[s]:
            continue
        a, b = slots[s][key]
        r = b.shape[1]
        for j in range(len(offs) - 1):
            aj, bj = a[j * r:(j + 1) * r].double(), b[offs[j]:offs[j + 1]].double()
            y[i, offs[j]:offs[j + 1]] += scalings[s] * (bj @ (aj @ x[i].double()))
    return y


def run(ts, key, slot_of_token, g):
    in_f, offs = MODULES[key]
    x = torch.randn(len(slot_of_token), in_f, generator=g)
    y0 = torch.randn(len(slot_of_token), offs[-1], generator=g)
    meta = SegmentMeta.build(torch.tensor(slot_of_token, dtype=torch.int32), SLOTS)
    y = lora_forward(x, y0.clone(), meta, ts.weights(key), impl="triton")
    return x, y0, y


def test_rebinding_refills_every_modules_tables_in_place():
    ts = TableSet(MODULES, SLOTS, R_MAX, torch.float32, "cpu")
    first = ts.weights((0, "qkv"))._tables["ptrs"]
    addresses = {k: t.data_ptr() for k, t in first.items()}
    a, b, c = adapter(1, 8), adapter(2, 4, modules=[(0, "qkv"), (1, "qkv")]), adapter(3, 2)
    g = torch.Generator().manual_seed(0)
    tokens = [0, 0, 1, -1, 2, 1, 2, 0]
    for slots, scalings in (([a, b, None], [2.0, 0.5, 0.0]), ([c, None, a], [1.0, 0.0, 0.25]), ([b, b, c], [1, 3, 2])):
        ts.refill(slots, scalings)
        for key in MODULES:
            x, y0, y = run(ts, key, tokens, g)
            torch.testing.assert_close(y.double(), expected(x, y0, key, tokens, slots, scalings), atol=1e-4,
                                       rtol=1e-4, msg=f"{key} bound to {[None if s is None else id(s) for s in slots]}")
        assert {k: t.data_ptr() for k, t in ts.weights((0, "qkv"))._tables["ptrs"].items()} == addresses
    # "down" is absent from b: its rank there is 0 (nothing computed), not a stale pointer
    assert ts.weights((0, "down"))._tables["ptrs"]["ranks"].tolist() == [0, 0, 2]


def test_weights_that_do_not_fit_are_named():
    ts = TableSet(MODULES, SLOTS, R_MAX, torch.float32, "cpu")
    with pytest.raises(ValueError, match="rank <= 24"):
        ts.refill([adapter(1, 16), None, None], [1.0, 0.0, 0.0])  # rank 16 > the max rank 8
    wrong = {k: (a.double(), b.double()) for k, (a, b) in adapter(1, 4).items()}
    with pytest.raises(ValueError, match="float32"):
        ts.refill([None, wrong, None], [0.0, 1.0, 0.0])
    with pytest.raises(ValueError, match="2 slots"):
        ts.refill([None, None], [0.0, 0.0])

"""Plain per-token torch math for the LoRA op (the kernel tests' oracle), test problems, and the tolerance table."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_multilora.segments import NO_ADAPTER

TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """One tolerance per dtype (of `actual`), compared in float32."""
    tol = TOLERANCE[actual.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@dataclass
class Problem:
    x: torch.Tensor  # (T, in)
    y0: torch.Tensor  # (T, out): the base output the delta is added to
    token_slot: torch.Tensor  # int32 (T,)
    lora_a: list[torch.Tensor | None]  # per slot (num_slices * r, in)
    lora_b: list[torch.Tensor | None]  # per slot (out, r)
    scalings: list[float]
    slice_offsets: tuple[int, ...]


def popularity_slots(kind: str, num_tokens: int, num_slots: int, base_fraction: float, g: torch.Generator):
    """Per-token slot index: identical (all slot 0), distinct (token i -> slot i), uniform, zipf:1.5; a fraction
    of tokens gets NO_ADAPTER."""
    if kind == "identical":
        slots = torch.zeros(num_tokens, dtype=torch.int64)
    elif kind == "distinct":
        slots = torch.arange(num_tokens) % num_slots
    elif kind == "uniform":
        slots = torch.randint(0, num_slots, (num_tokens,), generator=g)
    elif kind.startswith("zipf"):
        s = float(kind.split(":")[1])
        p = 1.0 / torch.arange(1, num_slots + 1, dtype=torch.float64) ** s
        slots = torch.multinomial(p / p.sum(), num_tokens, replacement=True, generator=g)
    else:
        raise ValueError(kind)
    base = torch.rand(num_tokens, generator=g) < base_fraction
    return slots.masked_fill(base, NO_ADAPTER).to(torch.int32)


def make_problem(
    *, num_tokens: int, in_features: int, slice_widths: list[int], ranks: list[int | None], popularity: str,
    dtype: torch.dtype, base_fraction: float = 0.25, seed: int = 0,
) -> Problem:
    g = torch.Generator().manual_seed(seed)
    offsets = [0]
    for w in slice_widths:
        offsets.append(offsets[-1] + w)
    n_sl = len(slice_widths)
    lora_a = [None if r is None else (torch.randn(n_sl * r, in_features, generator=g) / in_features**0.5).to(dtype)
              for r in ranks]
    lora_b = [None if r is None else (torch.randn(offsets[-1], r, generator=g) / r**0.5).to(dtype) for r in ranks]
    scalings = [0.5 + 0.25 * i for i in range(len(ranks))]
    return Problem(
        x=torch.randn(num_tokens, in_features, generator=g).to(dtype),
        y0=torch.randn(num_tokens, offsets[-1], generator=g).to(dtype),
        token_slot=popularity_slots(popularity, num_tokens, len(ranks), base_fraction, g),
        lora_a=lora_a, lora_b=lora_b, scalings=scalings, slice_offsets=tuple(offsets),
    )


def expected_output(p: Problem) -> torch.Tensor:
    """y0 + LoRA delta, token by token in float64."""
    y = p.y0.double().clone()
    offs = p.slice_offsets
    for i, s in enumerate(p.token_slot.tolist()):
        if s == NO_ADAPTER or p.lora_a[s] is None:
            continue
        r = p.lora_b[s].shape[1]
        for j in range(len(offs) - 1):
            a = p.lora_a[s][j * r : (j + 1) * r].double()
            b = p.lora_b[s][offs[j] : offs[j + 1]].double()
            y[i, offs[j] : offs[j + 1]] += p.scalings[s] * (b @ (a @ p.x[i].double()))
    return y

"""Per-step LoRA batch layout: which tokens of a forward batch go through which adapter.

Lives here: turning per-request facts (adapter, number of new tokens, where the adapter starts to apply) into token
groups that the LoRA ops consume. Not here: the ops themselves (`sgl_multilora.triton_kernels`) or SGLang's batch.

Running example (a batch of three requests, 9 new tokens):

    request            adapter   new tokens   adapter applies from new token
    r0 (base)          None      3            -
    r1 (LoRA "caps")   A         4            0   (a standard LoRA applies to every token)
    r2 (aLoRA "chk")   X         2            1   (aLoRA: its activation start k falls inside this chunk)

    token index        0  1  2 | 3  4  5  6 | 7  8
    token_adapter     -1 -1 -1 | 0  0  0  0 |-1  1      (-1: no adapter; these tokens cost no LoRA FLOPs)
    groups            [(adapter A, tokens [3, 4, 5, 6]), (adapter X, tokens [8])]
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

NO_ADAPTER = -1


@dataclass(frozen=True, slots=True)
class TokenGroup:
    """The tokens of one step that go through adapter `key` (row indices into the step's flattened tokens)."""

    key: Hashable
    token_index: torch.Tensor  # int64, (n,), ascending


@dataclass(frozen=True, slots=True)
class SegmentMeta:
    """The LoRA layout of one forward step. Immutable; valid for the step it was built for."""

    num_tokens: int
    token_adapter: torch.Tensor  # int32, (num_tokens,): index into `groups`, or NO_ADAPTER
    groups: tuple[TokenGroup, ...]

    @property
    def has_lora(self) -> bool:
        return bool(self.groups)

    @staticmethod
    def build(
        adapters: Sequence[Hashable | None],
        new_token_lens: Sequence[int],
        lora_starts: Sequence[int] | None = None,
        device: torch.device | str = "cpu",
    ) -> "SegmentMeta":
        """Builds the layout of a step whose requests contribute `new_token_lens[i]` consecutive tokens each.

        `adapters[i]` is the adapter key of request i (None: base model); `lora_starts[i]` is the first of its new
        tokens the adapter applies to (0 for a standard LoRA; clamped to [0, new_token_lens[i]]).
        """
        if len(adapters) != len(new_token_lens):
            raise ValueError(f"{len(adapters)} adapters for {len(new_token_lens)} requests")
        starts = lora_starts if lora_starts is not None else [0] * len(adapters)
        num_tokens = int(sum(new_token_lens))
        token_adapter = torch.full((num_tokens,), NO_ADAPTER, dtype=torch.int32)
        group_of: dict[Hashable, int] = {}
        ranges: list[list[tuple[int, int]]] = []
        offset = 0
        for key, n, start in zip(adapters, new_token_lens, starts):
            begin = offset + min(max(int(start), 0), n)
            end = offset + n
            offset = end
            if key is None or begin >= end:
                continue
            g = group_of.setdefault(key, len(group_of))
            if g == len(ranges):
                ranges.append([])
            ranges[g].append((begin, end))
            token_adapter[begin:end] = g
        groups = tuple(
            TokenGroup(key=key, token_index=torch.cat([torch.arange(b, e) for b, e in ranges[g]]).to(device))
            for key, g in group_of.items()
        )
        return SegmentMeta(num_tokens=num_tokens, token_adapter=token_adapter.to(device), groups=groups)

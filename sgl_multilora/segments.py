"""The per-step LoRA layout: which tokens of a forward step go through which adapter slot.

Lives here: `NO_ADAPTER` and `SegmentMeta`, built once per step and read by the CPU LoRA layers, the
kernels (`sgl_multilora.triton_kernels`) and SGLang's LoRA backend. Not here: the kernels, the
weight tables (`triton_kernels/weights.py`), SGLang's batch (the hooks in `patches/` read it).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from itertools import pairwise

import torch

NO_ADAPTER = -1  # the slot of a token no adapter applies to (base tokens, aLoRA tokens before k)


class SegmentMeta:
    """Tokens of one step grouped by adapter slot, in buffers sized once and refilled every step.

    Running example: room for 16 tokens on 3 slots; a step of three requests on two adapters plus
    base tokens (10 new tokens):

        request   adapter       new tokens   adapter applies from new token
        r0        A (LoRA)      3            0   (a standard LoRA applies to every token)
        r1        None (base)   2            -
        r2        X (aLoRA)     3            1   (its activation start k falls inside this chunk)
        r3        A (LoRA)      2            0

    `prepare_requests(["A", None, "X", "A"], [3, 2, 3, 2], [0, 0, 1, 0])` numbers the adapters by
    first appearance (A -> slot 0, X -> slot 1; slot 2 has no tokens this step) and fills:

        token              0  1  2 | 3  4 | 5  6  7 | 8  9
        token_slot         0  0  0 |-1 -1 |-1  1  1 | 0  0    (-1 = NO_ADAPTER: no LoRA FLOPs)
        keys               ("A", "X")                         (slot s serves keys[s])
        sorted_token_ids   0  1  2  8  9 | 6  7 | 3  4  5     (stable by slot; NO_ADAPTER tail last)
        tokens per slot    5  2  0                            (counts: p[s + 1] - p[s])
        seg_indptr = p     0  5  7  7                         (start offsets into sorted_token_ids)

    Slot s owns the tokens sorted_token_ids[p[s]:p[s + 1]]; tokens past p[num_slots] are NO_ADAPTER.

    A kernel program handles a block of one slot's tokens; programs over empty slots, rank-0 slots
    and the NO_ADAPTER tail exit at once, so base tokens cost nothing. `prepare` (per-token slots
    already on the device) runs only device ops into the preallocated buffers, so a CUDA graph that
    reads them stays valid when the batch's adapters change between capture and replay. Everything
    read from a layout is valid until its next `prepare`, `prepare_requests` or `reserve`.
    """

    def __init__(self, max_tokens: int, num_slots: int, device: torch.device | str):
        if max_tokens < 0 or num_slots < 1:
            raise ValueError(
                f"SegmentMeta needs max_tokens >= 0 and num_slots >= 1, "
                f"got {max_tokens}, {num_slots}"
            )
        self.num_slots = num_slots
        self.seg_indptr = torch.zeros(num_slots + 1, dtype=torch.int32, device=device)
        self._counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
        self._allocate_tokens(max_tokens)
        self.num_tokens = 0
        # slot s serves keys[s] after `prepare_requests`; () after `prepare` (the caller's slots)
        self.keys: tuple[Hashable, ...] = ()
        # A padded step (CUDA graphs) may serve inputs with fewer rows than it was prepared for: the
        # tokens past the batch are NO_ADAPTER padding, never referenced.
        self.padded = False
        self._rows: list[torch.Tensor] | None = None
        self._host: tuple[list[int], torch.Tensor | None] | None = None

    def _allocate_tokens(self, max_tokens: int) -> None:
        device = self.seg_indptr.device
        self.max_tokens = max_tokens
        self.token_slot = torch.full((max_tokens,), NO_ADAPTER, dtype=torch.int32, device=device)
        self.sorted_token_ids = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self._sort_keys = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self._ones = torch.ones(max_tokens, dtype=torch.int64, device=device)

    @staticmethod
    def make(max_tokens: int, num_slots: int, device: torch.device | str) -> SegmentMeta:
        """Buffers for up to `max_tokens` tokens per step on `num_slots` adapter slots. Call once,
        then `prepare` (or `prepare_requests`) every step."""
        return SegmentMeta(max_tokens, num_slots, device)

    @staticmethod
    def build(token_slot: torch.Tensor, num_slots: int) -> SegmentMeta:
        """A layout sized exactly for `token_slot` and prepared with it (eager use, tests)."""
        meta = SegmentMeta(int(token_slot.shape[0]), num_slots, token_slot.device)
        meta.prepare(token_slot)
        return meta

    @property
    def device(self) -> torch.device:
        return self.seg_indptr.device

    def reserve(self, num_tokens: int) -> None:
        """Grows the token buffers (to the next power of two) unless `num_tokens` fit, dropping the
        prepared step. Reallocates: never call it on a layout that a captured CUDA graph reads."""
        if num_tokens > self.max_tokens:
            self._allocate_tokens(1 << (num_tokens - 1).bit_length())
            self.num_tokens, self.keys, self._rows, self._host = 0, (), None, None

    def prepare(self, token_slot: torch.Tensor, *, padded: bool = False) -> None:
        """Refills the layout for a step. token_slot: int (num_tokens,) on the layout's device,
        values in [0, num_slots) or NO_ADAPTER; it may be a view of `self.token_slot` that the
        caller filled.

        `padded`: a padded step (CUDA graphs): inputs may have fewer rows than `num_tokens`, and the
        entries past them are NO_ADAPTER. Mutates the layout in place; raises ValueError when the
        tokens exceed the capacity. No host sync on a GPU: values are checked on a CPU only, where
        that is free (`check` does it anywhere).
        """
        n = int(token_slot.shape[0])
        if n > self.max_tokens:
            raise ValueError(f"{n} tokens exceed the layout's capacity of {self.max_tokens}")
        if token_slot.device != self.device:
            raise ValueError(f"token_slot is on {token_slot.device}, the layout on {self.device}")
        if self.device.type == "cpu":
            self.check(token_slot)
        self.num_tokens, self.padded, self.keys, self._rows, self._host = n, padded, (), None, None
        if token_slot.data_ptr() != self.token_slot.data_ptr():
            self.token_slot[:n].copy_(token_slot)
        keys = self._sort_keys[:n]
        keys.copy_(self.token_slot[:n])
        keys.masked_fill_(keys < 0, self.num_slots)  # NO_ADAPTER sorts last, past seg_indptr[-1]
        self.sorted_token_ids[:n].copy_(torch.argsort(keys, stable=True))
        self._counts.zero_()
        self._counts.scatter_add_(0, keys, self._ones[:n])
        self.seg_indptr[1:].copy_(torch.cumsum(self._counts[: self.num_slots], dim=0))

    def prepare_requests(
        self,
        adapters: Sequence[Hashable | None],
        new_token_lens: Sequence[int],
        lora_starts: Sequence[int] | None = None,
    ) -> None:
        """Refills the layout for a step whose request i contributes `new_token_lens[i]` consecutive
        tokens. `adapters[i]` is its adapter key (None: the base model); keys get slots in order of
        first appearance (`keys`). `lora_starts[i]` is the first of its new tokens the adapter
        applies to (0 for a standard LoRA; clamped to [0, new_token_lens[i]]). Builds the slots on
        the host (one copy to a GPU). Raises ValueError for more adapters than slots or more tokens
        than the capacity.
        """
        if len(adapters) != len(new_token_lens):
            raise ValueError(f"{len(adapters)} adapters for {len(new_token_lens)} requests")
        starts = lora_starts if lora_starts is not None else [0] * len(adapters)
        num_tokens = int(sum(new_token_lens))
        if num_tokens > self.max_tokens:
            raise ValueError(
                f"{num_tokens} tokens exceed the layout's capacity of {self.max_tokens}"
            )
        on_cpu = self.device.type == "cpu"
        if on_cpu:  # filled in place
            host = self.token_slot[:num_tokens]
        else:
            host = torch.empty(num_tokens, dtype=torch.int32)
        host.fill_(NO_ADAPTER)
        slot_of: dict[Hashable, int] = {}
        offset = 0
        for key, n, start in zip(adapters, new_token_lens, starts):
            begin, end = offset + min(max(int(start), 0), n), offset + n
            offset = end
            if key is None or begin >= end:
                continue
            slot = slot_of.setdefault(key, len(slot_of))
            if slot >= self.num_slots:
                raise ValueError(f"more than {self.num_slots} adapters in one step (its slots)")
            host[begin:end] = slot
        self.prepare(host if on_cpu else host.to(self.device))
        self.keys = tuple(slot_of)

    def check_rows(self, num_rows: int, what: str) -> None:
        """Raises ValueError unless an input of `num_rows` rows fits the prepared step."""
        if num_rows == self.num_tokens or (self.padded and num_rows <= self.num_tokens):
            return
        raise ValueError(
            f"{what} has {num_rows} rows but the layout was prepared for {self.num_tokens} tokens"
        )

    def check(self, token_slot: torch.Tensor) -> None:
        """Raises ValueError naming the first bad slot value (syncs with the device)."""
        bad = (token_slot < NO_ADAPTER) | (token_slot >= self.num_slots)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(
                f"token {i} has slot {int(token_slot[i])}; "
                f"expected {NO_ADAPTER} (no adapter) or 0..{self.num_slots - 1}"
            )

    def slot_rows(self, slot: int) -> torch.Tensor:
        """The ascending token rows of `slot`, int64, for the torch references. Syncs once per step;
        cached, since every layer of the step reads the same rows."""
        if self._rows is None:
            ids = self.sorted_token_ids
            self._rows = [ids[b:e].long() for b, e in pairwise(self.seg_indptr.tolist())]
        return self._rows[slot]

    def host_segments(self) -> tuple[list[int], torch.Tensor | None]:
        """(seg_indptr as a list, the adapter tokens' rows in slot order as int64), for the host op
        (`triton_kernels/host.py`); the rows are None when they are 0..seg_indptr[-1]-1 in order. Syncs once per
        step; cached, since every layer of the step reads the same."""
        if self._host is None:
            bounds = self.seg_indptr.tolist()
            ids = self.sorted_token_ids[: bounds[-1]].long()
            in_order = bool(torch.equal(ids, torch.arange(bounds[-1], device=ids.device)))
            self._host = (bounds, None if in_order else ids)
        return self._host

    def check_invariants(self) -> None:
        """Asserts that the buffers describe the prepared `token_slot` (syncs; for tests)."""
        n, p = self.num_tokens, self.seg_indptr.tolist()
        slots = self.token_slot[:n].tolist()
        ids = self.sorted_token_ids[:n].tolist()
        assert p[0] == 0 and all(a <= b for a, b in pairwise(p)), f"seg_indptr not ascending: {p}"
        assert sorted(ids) == list(range(n)), "sorted_token_ids is not a permutation of the tokens"
        for s in range(self.num_slots):
            rows = ids[p[s] : p[s + 1]]
            assert rows == sorted(rows), f"slot {s}: token rows out of order {rows}"
            assert all(slots[i] == s for i in rows), f"slot {s} owns tokens of another slot: {rows}"
        tail = ids[p[-1] :]
        assert all(slots[i] == NO_ADAPTER for i in tail), f"adapter tokens in the tail: {tail}"
        assert len(self.keys) <= self.num_slots, f"{len(self.keys)} keys for {self.num_slots} slots"

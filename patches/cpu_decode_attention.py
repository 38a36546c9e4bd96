"""CPU decode attention (`--attention-backend torch_native`) in a few batched calls instead of one per request.

Not here: extend attention (cpu_extend_attention.py) and the KV writes (`forward_decode` does them before calling
this).

SGLang 0.5.23's `TorchNativeAttnBackend._run_sdpa_forward_decode` loops over the batch in Python: per request and
layer it slices the query, gathers the request's K and V rows from the pool and calls SDPA on one query row. On a
2-core CPU serving SmolLM2-135M that loop was about 15% of a decode step under load (py-spy of the scheduler),
mostly per-call overhead: 16 requests x 30 layers are 480 SDPA calls a step. Here the requests of a step are put
in groups of similar KV length, once per step, and each group is one SDPA call over a padded block:

    request   KV slots (req_to_token row)      group block [n, L]          mask (True: attend)
    r2  (7)   a a a a a a a                    a a a a a a a               1 1 1 1 1 1 1
    r0  (6)   b b b b b b           ->         b b b b b b b*              1 1 1 1 1 1 0
    r3  (5)   c c c c c                        c c c c c c* c*             1 1 1 1 1 0 0
    r1  (1)   d                     ->  next group (padding it here would cost more than a call)

    * padding: the request's first slot again, masked out (exp(-inf) = 0, so the result is the unpadded one)

The query row of request i attends to all of its KV (decode is causal by construction: the row is the last
position); with a sliding window w, to its last w + 1 positions only, so the window is a trim of the row, not a mask.
Groups come from the lengths sorted in descending order: a request joins the current group unless the padding it
adds (the group's length minus its own) is more than `PAD_ROWS_PER_CALL`, what one more call costs in KV rows
(then it starts the next group). The layout (groups, slot blocks, masks) depends only on the step's requests
(and the layer's window), so it is built once per step and window and reused by every layer: the cache holds the
step's `seq_lens`, `req_pool_indices` and `req_to_token` themselves (not their ids, which a later tensor may
reuse) with their in-place versions. Each decode step has a new `seq_lens` and writes its new slots into
`req_to_token` in place, so no step reuses another's layout.

Handled: decode self-attention without encoder tokens, with or without a sliding window. SGLang's method keeps
cross-attention, encoder-decoder batches (`encoder_lens` given) and a `causal=True` call (SDPA's upper-left causal
mask would show the query its first key only; SGLang's decode never passes it).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch.nn.functional import scaled_dot_product_attention

from sgl_multilora.patches import flags

# Padding rows one more SDPA call is worth: a request whose KV is shorter than its group's longest by more than this
# starts a new group. eval/bench/cpu_decode.py times it (`--pad-rows`) on SmolLM2 shapes (eval/RESULTS.md).
PAD_ROWS_PER_CALL = 64


def run_sdpa_forward_decode(original, self, *args, **kwargs):
    """AROUND hook on `TorchNativeAttnBackend._run_sdpa_forward_decode`: same arguments, result."""
    if flags.current().decode_attention == "ours" and _handles(self, *args, **kwargs):
        return sdpa_forward_decode(self, *args, **kwargs)
    return original(self, *args, **kwargs)


def _handles(
    self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, encoder_lens=None,
    scaling=None, enable_gqa=False, causal=False, is_cross_attn=False, sliding_window_size=None,
) -> bool:
    return not causal and not is_cross_attn and encoder_lens is None


@dataclass(frozen=True)
class Group:
    """Requests attended in one call. rows: their positions in the batch [n]; slots: their KV slots, padded
    [n, length]; mask: [n, 1, 1, length] (True: attend), None when every request fills the block."""

    rows: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor | None


@dataclass(frozen=True)
class DecodeLayout:
    groups: tuple[Group, ...]


class _StepCache(threading.local):
    """The current step's layouts, one per sliding window seen (layers may differ in it), and the step's inputs
    they were built from: (tensor, its version) for req_to_token, req_pool_indices and seq_lens."""

    step: tuple = ()
    layouts: dict[int | None, DecodeLayout]

    def __init__(self) -> None:
        self.layouts = {}


_cache = _StepCache()


def decode_layout(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                  sliding_window_size: int | None) -> DecodeLayout:
    """The step's groups (module docstring); the cached ones while the step's inputs are the same objects, unchanged."""
    step = ((req_to_token, req_to_token._version), (req_pool_indices, req_pool_indices._version),
            (seq_lens, seq_lens._version))
    if len(_cache.step) != len(step) or any(t is not u or v != w for (t, v), (u, w) in zip(_cache.step, step)):
        _cache.step, _cache.layouts = step, {}
    layout = _cache.layouts.get(sliding_window_size)
    if layout is None:
        layout = DecodeLayout(_groups(req_to_token, req_pool_indices, seq_lens, sliding_window_size))
        _cache.layouts[sliding_window_size] = layout
    return layout


def _groups(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
            sliding_window_size: int | None) -> tuple[Group, ...]:
    lens = seq_lens.tolist()
    window = sliding_window_size if sliding_window_size is not None and sliding_window_size > -1 else None
    starts = [0 if window is None else max(0, n - 1 - window) for n in lens]
    kv_lens = [n - s for n, s in zip(lens, starts)]
    order = sorted(range(len(lens)), key=lambda i: -kv_lens[i])
    members: list[list[int]] = []
    for i in order:
        if members:
            head = kv_lens[members[-1][0]]
            if head - kv_lens[i] <= PAD_ROWS_PER_CALL:
                members[-1].append(i)
                continue
        members.append([i])
    device = req_to_token.device
    groups = []
    for rows in members:
        length = kv_lens[rows[0]]
        idx = torch.tensor(rows, dtype=torch.long, device=device)
        group_lens = torch.tensor([kv_lens[i] for i in rows], device=device)
        group_starts = torch.tensor([starts[i] for i in rows], device=device)
        offsets = torch.arange(length, device=device)
        valid = offsets[None, :] < group_lens[:, None]
        positions = group_starts[:, None] + torch.where(valid, offsets[None, :], 0)
        slots = req_to_token[req_pool_indices[idx].long()[:, None], positions].long()
        mask = None if bool(valid.all()) else valid[:, None, None, :]
        groups.append(Group(idx, slots, mask))
    return tuple(groups)


def sdpa_forward_decode(
    self,
    query: torch.Tensor,
    output: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    encoder_lens: torch.Tensor | None = None,
    scaling: float | None = None,
    enable_gqa: bool = False,
    causal: bool = False,
    is_cross_attn: bool = False,
    sliding_window_size: int | None = None,
) -> torch.Tensor:
    """Decode attention, SGLang's result in one SDPA call per group of similar lengths.

    Semantics: for request r, with L = seq_lens[r] and s = max(0, L - 1 - w) under a window w (else s = 0),
        K_r = k_cache[req_to_token[req_pool_indices[r], s:L]]  (V_r alike)
        output[r] = softmax(scaling * query[r] @ K_r.T) @ V_r
    query, output: [num_reqs, num_q_heads, head_dim] (output written in place and returned)
    k_cache, v_cache: [pool_size, num_kv_heads, head_dim], cast to query's dtype
    enable_gqa: num_q_heads is a multiple of num_kv_heads; scaling None: 1 / sqrt(head_dim).
    Requires self-attention without encoder tokens and causal=False (run_sdpa_forward_decode routes the rest).
    """
    assert not causal and not is_cross_attn and encoder_lens is None, (
        "only decode self-attention comes here; run_sdpa_forward_decode routes the rest to SGLang"
    )
    if seq_lens.shape[0] == 0:
        return output
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[1]
    if num_q_heads % num_kv_heads or (num_q_heads != num_kv_heads and not enable_gqa):
        raise ValueError(f"{num_q_heads} query heads over {num_kv_heads} KV heads (enable_gqa={enable_gqa})")
    for group in decode_layout(req_to_token, req_pool_indices, seq_lens, sliding_window_size).groups:
        n, length = group.slots.shape
        flat = group.slots.view(-1)
        key = k_cache.index_select(0, flat).view(n, length, *k_cache.shape[1:]).transpose(1, 2)
        value = v_cache.index_select(0, flat).view(n, length, *v_cache.shape[1:]).transpose(1, 2)
        if key.dtype != query.dtype:
            key, value = key.to(query.dtype), value.to(query.dtype)
        # The query heads sharing a KV head are that head's query rows: [n, kv_heads, q_heads / kv_heads, dim]
        # (head h reads KV head h // group size, as enable_gqa has it), one plain attention, no K/V repeated.
        q = query.index_select(0, group.rows).view(n, num_kv_heads, -1, head_dim)
        out = scaled_dot_product_attention(q, key, value, attn_mask=group.mask, scale=scaling)
        output.index_copy_(0, group.rows, out.reshape(n, -1, out.shape[-1]).to(output.dtype))
    return output

"""CPU extend attention (`--attention-backend torch_native`) that skips the cached prefix's rows.

Not here: decode attention (one query row per request already) and the KV writes (`forward_extend`
does them before calling this).

SGLang 0.5.23's `TorchNativeAttnBackend._run_sdpa_forward_extend` builds, per request, a query as
long as the whole sequence (prefix + new tokens), fills only the new rows, runs causal attention
over all of it, then drops the prefix rows. Its cost grows with the square of the full length
however much of it was cached: on a CPU SmolLM2-135M server, 3 new tokens after 2048 cached ones
took a third of a cold 2048-token prefill (eval/bench/cpu_extend.py). Here a request's new tokens
attend to its cached prefix plus themselves, with the causal mask aligned to the lower right:

    keys:          0 ... prefix_len-1 | prefix_len ... seq_len-1
    new token i:   all visible        | visible up to prefix_len + i

That costs extend_len x seq_len, as a dense mask. Where most of the sequence is new (prefix_len <
extend_len), SGLang's square causal call, which skips the masked half, costs less and is kept.

Handled: causal self-attention without encoder tokens, with or without a sliding window. SGLang's
method keeps non-causal attention (encoder-only layers, cross-attention) and encoder-decoder
batches (`encoder_lens` given). The same change proposed to SGLang itself,
`patches/upstream/torch_native_extend.diff`, covers those too: there as well the dropped rows were
never used.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

from sgl_multilora.patches import flags


def run_sdpa_forward_extend(original, self, *args, **kwargs):
    """AROUND hook on `TorchNativeAttnBackend._run_sdpa_forward_extend`: same arguments, result."""
    if flags.current().extend_attention == "ours" and _handles(self, *args, **kwargs):
        return sdpa_forward_extend(self, *args, **kwargs)
    return original(self, *args, **kwargs)


def _handles(
    self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
    extend_prefix_lens, extend_seq_lens, encoder_lens=None, scaling=None, enable_gqa=False,
    causal=False, is_cross_attn=False, sliding_window_size=None,
) -> bool:
    return causal and not is_cross_attn and encoder_lens is None


def sdpa_forward_extend(
    self,
    query: torch.Tensor,
    output: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    encoder_lens: torch.Tensor | None = None,
    scaling: float | None = None,
    enable_gqa: bool = False,
    causal: bool = False,
    is_cross_attn: bool = False,
    sliding_window_size: int | None = None,
) -> torch.Tensor:
    """Causal extend attention, SGLang's result at the cost of the new tokens' rows (`_attend`).

    Semantics: for request r, with p = extend_prefix_lens[r], w = sliding_window_size,
        K_r = k_cache[req_to_token[req_pool_indices[r], :seq_lens[r]]]  (V_r alike)
        Q_r = the extend_seq_lens[r] rows of `query` (requests back to back)
        output_r = softmax(scaling * Q_r @ K_r.T + M_r) @ V_r
        M_r[i, j] = 0 if j <= p + i (and, with a window, j >= p + i - w) else -inf
    query, output: [num_tokens, num_q_heads, head_dim] (output written in place and returned)
    k_cache, v_cache: [pool_size, num_kv_heads, head_dim], cast to query's dtype
    enable_gqa: num_q_heads is a multiple of num_kv_heads; scaling None: 1 / sqrt(head_dim).
    Requires causal self-attention without encoder tokens, and
    seq_lens == extend_prefix_lens + extend_seq_lens.
    """
    assert causal and not is_cross_attn and encoder_lens is None, (
        "only causal self-attention comes here; run_sdpa_forward_extend routes the rest to SGLang"
    )
    query = query.movedim(0, 1)  # [num_q_heads, num_tokens, head_dim]
    start_q = 0
    for req_pool_idx, seq_len, prefix_len, extend_len in zip(
        req_pool_indices.tolist(), seq_lens.tolist(), extend_prefix_lens.tolist(),
        extend_seq_lens.tolist(),
    ):
        end_q = start_q + extend_len
        req_query = query[:, start_q:end_q]
        req_tokens = req_to_token[req_pool_idx, :seq_len]
        req_key = k_cache[req_tokens].movedim(0, 1).to(req_query.dtype)
        req_value = v_cache[req_tokens].movedim(0, 1).to(req_query.dtype)
        req_out = _attend(self, req_query, req_key, req_value, prefix_len, sliding_window_size,
                          scaling, enable_gqa)
        output[start_q:end_q] = req_out.movedim(1, 0)
        start_q = end_q
    return output


def _attend(
    self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, prefix_len: int,
    sliding_window_size: int | None, scaling: float | None, enable_gqa: bool,
) -> torch.Tensor:
    """One request's attention; returns [num_q_heads, extend_len, head_dim].

    query: [num_q_heads, extend_len, head_dim], the tokens at positions prefix_len onwards
    key, value: [num_kv_heads, prefix_len + extend_len, head_dim]

    Mostly cached (prefix_len >= extend_len): the new rows alone, under an explicit mask; SDPA's
    `is_causal` is aligned to the upper left, wrong once there is a prefix, and a single new token
    needs no mask. Mostly new: SGLang's layout, the query padded in front to the full length so
    that `is_causal` applies; the kernel then skips the masked half, which costs less than the
    extend_len x seq_len dense mask (the two break even at prefix_len == extend_len).
    """
    extend_len, seq_len = query.shape[1], key.shape[1]
    attn_mask, is_causal, num_pad_rows = None, False, 0
    if sliding_window_size is not None and sliding_window_size > -1:
        attn_mask = self._make_sliding_window_mask(
            q_len=extend_len, kv_len=seq_len, sliding_window_size=sliding_window_size,
            device=query.device, query_offset=prefix_len,
        )
    elif prefix_len < extend_len:
        is_causal, num_pad_rows = True, prefix_len
        if num_pad_rows:
            query = torch.nn.functional.pad(query, (0, 0, num_pad_rows, 0))  # zero rows in front
    elif extend_len > 1:
        attn_mask = torch.ones(extend_len, seq_len, dtype=torch.bool, device=query.device)
        attn_mask = attn_mask.tril(diagonal=prefix_len)
    out = scaled_dot_product_attention(
        query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0), attn_mask=attn_mask,
        is_causal=is_causal, enable_gqa=enable_gqa, scale=scaling,
    )
    return out.squeeze(0)[:, num_pad_rows:]

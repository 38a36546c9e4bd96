"""`--lora-backend multilora`: SGLang's LoRA layers computed with `sgl_multilora.triton_kernels` (one backend class).

SGLang's layers hand us its stacked per-slot buffers (A: (slots, n_slices * max_rank, in), B: (slots, out, max_rank))
and its per-request slot indices; we turn those into a per-token slot index (NO_ADAPTER for slots of rank 0, i.e.
base requests) in the step's `SegmentMeta`, and weight tables read in place. Ranks are not padded in the
compute: each slot runs at its own rank. Decode CUDA graphs read fixed-size buffers refilled by
`prepare_lora_batch` without a host sync, so the set of adapters may change between capture and replay.
With the unified pool on (`--radix-cache-backend multilora`), SGLang's layers hold zero-byte placeholders instead of
stacked buffers, and each slot's weights are read in place from the adapter's KV slots (`bind_pool`; the mapping
is drawn in `lora_pool_layers.py`).
Not here: the kernels themselves.
Unsupported here: embedding / lm_head LoRA, MoE LoRA and DP attention (refused up front with a clear error).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.lora.backend.base_backend import BaseLoRABackend
from sglang.srt.lora.utils import LoRABatchInfo, generate_sequence_lengths

from sgl_multilora.patches import flags
from sgl_multilora.patches.state import process_state
from sgl_multilora.segments import NO_ADAPTER, SegmentMeta
from sgl_multilora.triton_kernels.expand import lora_expand, lora_expand_ref
from sgl_multilora.triton_kernels.ops import lora_forward, resolve_impl
from sgl_multilora.triton_kernels.shrink import lora_shrink, lora_shrink_ref
from sgl_multilora.triton_kernels.weights import LoRAWeights, TableSet

NAME = "multilora"
_UNSUPPORTED_TARGETS = ("embed_tokens", "lm_head")


class MultiLoRABackend(BaseLoRABackend):
    name = NAME

    def __init__(self, max_loras_per_batch: int, device: torch.device, **kwargs):
        super().__init__(max_loras_per_batch, device)
        self.impl = resolve_impl(flags.current().lora_ops, torch.device(device))
        self.meta: SegmentMeta | None = None  # the current step's layout (eager, or a graph's)
        # Eager steps refill one layout, grown once for a step larger than any before; decode CUDA
        # graphs keep their own, fixed one.
        max_tokens, slots = _max_step_tokens(kwargs.get("server_args")), max(1, max_loras_per_batch)
        self._eager_meta = SegmentMeta.make(max_tokens, slots, device)
        self.ranks_cpu: tuple[int, ...] = ()
        self.scalings_cpu: tuple[float, ...] = ()
        self._graph: dict[str, object] | None = None
        self._tables: dict[tuple, dict[str, torch.Tensor]] = {}
        # Eager steps reuse one ranks / scalings buffer (kernels run in stream order), so the pointer tables
        # cached per weight buffer stay valid across steps.
        self._ranks = torch.zeros(max(1, max_loras_per_batch), dtype=torch.int32, device=device)
        self._scalings = torch.zeros(max(1, max_loras_per_batch), dtype=torch.float32, device=device)
        # The unified pool: placeholder data_ptr -> the module it stands for; per module, this binding's weights
        # (their device tables refilled in place, so captured decode graphs read the current binding).
        self.pool_modules: dict[int, PoolModule] = {}
        self._pool_key: tuple | None = None
        self._pool_weights: dict[tuple[int, str], LoRAWeights] = {}
        self._table_set: TableSet | None = None  # the Triton kernels' tables of every pool module
        process_state().lora_backend = self

    # ---- batch metadata ----------------------------------------------------------------------------------

    def init_decode_cuda_graph_batch_info(self, max_bs_in_cuda_graph: int, num_tokens_per_req: int):
        """Fixed-size buffers for decode graphs: every replay refills them in place (no host sync)."""
        n, slots = max_bs_in_cuda_graph * num_tokens_per_req, self.max_loras_per_batch
        dev = self.device
        self._graph = {
            "tokens_per_req": num_tokens_per_req,
            "meta": SegmentMeta.make(n, slots, dev),
            "req_slot": torch.full((max_bs_in_cuda_graph,), NO_ADAPTER, dtype=torch.int32, device=dev),
            "batch_info": LoRABatchInfo(
                use_cuda_graph=True, bs=max_bs_in_cuda_graph, num_segments=max_bs_in_cuda_graph,
                seg_indptr=torch.arange(0, n + 1, num_tokens_per_req, dtype=torch.int32, device=dev),
                weight_indices=torch.zeros(max_bs_in_cuda_graph, dtype=torch.int32, device=dev),
                lora_ranks=torch.zeros(slots, dtype=torch.int32, device=dev),
                scalings=torch.zeros(slots, dtype=torch.float32, device=dev),
                max_len=num_tokens_per_req,
                seg_lens=torch.full((max_bs_in_cuda_graph,), num_tokens_per_req, dtype=torch.int32, device=dev),
            ),
        }

    def prepare_lora_batch(
        self,
        forward_batch,
        weight_indices: list[int],
        lora_ranks: list[int],
        scalings: list[float],
        use_cuda_graph: bool,
        use_prefill_cuda_graph: bool = False,
    ):
        if use_prefill_cuda_graph:
            raise NotImplementedError("--lora-backend multilora does not support the prefill CUDA graph")
        dev = self.device
        bs = forward_batch.batch_size
        if len(lora_ranks) > self.max_loras_per_batch:
            raise ValueError(f"{len(lora_ranks)} LoRA slots exceed max_loras_per_batch={self.max_loras_per_batch}")
        self.ranks_cpu = tuple(int(r) for r in lora_ranks)
        self.scalings_cpu = tuple(float(s) for s in scalings)
        ranks_host = torch.tensor(list(lora_ranks), dtype=torch.int32)
        scalings_host = torch.tensor(list(scalings), dtype=torch.float32)
        req_slot_host = torch.tensor(list(weight_indices), dtype=torch.int32)
        if not forward_batch.forward_mode.is_idle() and len(weight_indices) != bs:
            raise ValueError(f"{len(weight_indices)} adapter slots for a batch of {bs} requests")
        has_active = any(self.ranks_cpu[w] > 0 for w in weight_indices if 0 <= w < len(self.ranks_cpu))
        if use_cuda_graph:
            g = self._graph
            assert g is not None, "init_decode_cuda_graph_batch_info was not called before a graph batch"
            info: LoRABatchInfo = g["batch_info"]
            info.lora_ranks.zero_()
            info.lora_ranks[: len(lora_ranks)].copy_(ranks_host, non_blocking=True)
            info.scalings[: len(scalings)].copy_(scalings_host, non_blocking=True)
            req_slot = g["req_slot"]
            req_slot.fill_(NO_ADAPTER)
            req_slot[:bs].copy_(req_slot_host, non_blocking=True)
            info.weight_indices[:bs].copy_(req_slot[:bs])
            meta: SegmentMeta = g["meta"]
            token_slot = meta.token_slot  # filled in place: device ops only, no host sync
            token_slot.copy_(torch.repeat_interleave(req_slot, g["tokens_per_req"]))
            self._mask_empty_slots(token_slot, info.lora_ranks)
            meta.prepare(token_slot, padded=True)
            info.bs = info.num_segments = bs
        else:
            seg_lens = generate_sequence_lengths(forward_batch, device=dev).to(torch.int32)
            num_tokens = _num_tokens(forward_batch)
            req_slot = req_slot_host.to(dev, non_blocking=True)
            self._ranks.zero_()
            self._ranks[: len(lora_ranks)].copy_(ranks_host, non_blocking=True)
            self._scalings.zero_()
            self._scalings[: len(scalings)].copy_(scalings_host, non_blocking=True)
            meta = self._eager_meta
            meta.reserve(num_tokens)
            token_slot = meta.token_slot[:num_tokens]
            token_slot.copy_(torch.repeat_interleave(req_slot, seg_lens, output_size=num_tokens))
            self._mask_empty_slots(token_slot, self._ranks)
            meta.prepare(token_slot)
            seg_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=dev)
            seg_indptr[1:] = torch.cumsum(seg_lens, dim=0)
            info = LoRABatchInfo(
                use_cuda_graph=False, bs=bs, num_segments=bs, seg_indptr=seg_indptr, weight_indices=req_slot,
                lora_ranks=self._ranks, scalings=self._scalings,
                max_len=max(forward_batch.extend_seq_lens_cpu) if forward_batch.forward_mode.is_extend() else 1,
                seg_lens=seg_lens,
            )
            info.expected_tokens = num_tokens
        info.has_active_lora = has_active
        self.meta = meta
        self.batch_info = info
        self.lm_head_batch_info = None
        self.lm_head_pass_batch_infos = None

    @staticmethod
    def _mask_empty_slots(token_slot: torch.Tensor, ranks: torch.Tensor) -> None:
        """Tokens of rank-0 slots (SGLang's base slot) become NO_ADAPTER, so they cost nothing (no host sync)."""
        valid = token_slot >= 0
        slot_rank = ranks.to(torch.int64)[token_slot.clamp(min=0).long()]
        token_slot.masked_fill_(~valid | (slot_rank == 0), NO_ADAPTER)

    # ---- ops ---------------------------------------------------------------------------------------------

    def _weights(self, a: torch.Tensor | None, b: torch.Tensor | None, offsets: tuple[int, ...]) -> LoRAWeights:
        info = self.batch_info
        assert info is not None and self.meta is not None, "LoRA op called before prepare_lora_batch"
        w = LoRAWeights.from_stacked(a, b, offsets, self.ranks_cpu, self.scalings_cpu,
                                     ranks=info.lora_ranks, scalings=info.scalings)
        key = (_ptr(a), _ptr(b), offsets, info.lora_ranks.data_ptr(), info.scalings.data_ptr())
        if key not in self._tables:  # pointer tables depend only on the buffers: build once, reuse in graphs
            self._tables[key] = w.tables()
        w._tables["ptrs"] = self._tables[key]
        return w

    def _lora(self, x: torch.Tensor, a, b, offsets, base_output: torch.Tensor | None) -> torch.Tensor:
        y = base_output
        if y is None:
            y = torch.zeros(x.shape[0], offsets[-1], dtype=x.dtype, device=x.device)
        if a.shape[0] == 0 or b.shape[-1] == 0:
            return y
        # LoRA may cover only a prefix of the base output's partitions (SGLang's lora_n_slices < n_slices)
        target = y if y.shape[1] == offsets[-1] else y[:, : offsets[-1]]
        w = self._pool_lookup(a) or self._weights(a, b, tuple(offsets))
        lora_forward(x.contiguous(), target, self.meta, w, impl=self.impl)
        return y

    # ---- the unified pool ------------------------------------------------------------------------------------

    def use_pool(self, modules: list[PoolModule]) -> None:
        """SGLang's layers hold placeholders for `modules` (each by the data_ptr of its A and of its B): their
        weights come from the slots `bind_pool` names."""
        if self.impl == "flashinfer":
            raise RuntimeError("--multilora-lora-ops flashinfer reads SGLang's stacked slot buffers, which the unified "
                               "pool replaces; use --multilora-lora-ops triton (or auto) with the pool, or "
                               "--multilora-stock-baseline memory")
        self.pool_modules = {}
        for m in modules:
            self.pool_modules[m.a_ptr] = self.pool_modules[m.b_ptr] = m
        self._pool_key = None
        self._pool_weights.clear()
        self._table_set = None

    def bind_pool(self, slots) -> None:
        """Per batch slot, the adapter whose weights it computes with (a `LoadedAdapter` of views into its KV
        slots) or None; after `prepare_lora_batch` (which set the slots' scalings). Nothing is rebuilt while the
        binding is unchanged. On a change: for the Triton kernels, every module's device tables are refilled in
        place at once (`TableSet`: a captured decode graph reads them at replay); for the torch references, each
        module's views are rebuilt."""
        if len(slots) != self.max_loras_per_batch:
            raise ValueError(f"{len(slots)} slots bound, max_loras_per_batch={self.max_loras_per_batch}")
        scalings = self.scalings_cpu + (0.0,) * (len(slots) - len(self.scalings_cpu))
        key = (tuple(0 if v is None else id(v) for v in slots), scalings, self.impl)
        if key == self._pool_key:
            return
        self._pool_key = key  # the bound views stay alive through the weights (keepalive / TableSet)
        modules = set(self.pool_modules.values())
        if self.impl == "triton":
            if self._table_set is None:
                m0 = next(iter(modules))
                self._table_set = TableSet({(m.layer, m.module): (m.in_features, m.offsets) for m in modules},
                                           self.max_loras_per_batch, m0.max_rank, m0.dtype, m0.device)
            try:
                self._table_set.refill([None if v is None else v.weights for v in slots], scalings)
            except ValueError as e:
                raise RuntimeError(f"pool weights do not fit SGLang's LoRA layers: {e}") from None
            for m in modules:
                self._pool_weights[(m.layer, m.module)] = self._table_set.weights((m.layer, m.module))
            return
        for m in modules:
            self._pool_weights[(m.layer, m.module)] = self._bind_module(m, slots, scalings)

    def _bind_module(self, m: PoolModule, slots, scalings) -> LoRAWeights:
        n = len(m.offsets) - 1
        a_views, b_views, ranks = [], [], []
        for views in slots:
            pair = None if views is None else views.weights.get((m.layer, m.module))
            if pair is None:
                a_views.append(()), b_views.append(()), ranks.append(0)
                continue
            a, b = pair
            r = a.shape[0] // n
            if a.shape != (n * r, m.in_features) or b.shape != (m.offsets[-1], r) or a.dtype != m.dtype:
                raise RuntimeError(f"pool weights of layer {m.layer} {m.module} are {a.dtype} {tuple(a.shape)} / "
                                   f"{tuple(b.shape)}; the layer needs {m.dtype} ({n} * rank, {m.in_features}) / "
                                   f"({m.offsets[-1]}, rank)")
            a_views.append(tuple(a[j * r:(j + 1) * r] for j in range(n)))
            b_views.append(tuple(b[m.offsets[j]:m.offsets[j + 1]] for j in range(n)))
            ranks.append(r)
        return LoRAWeights(in_features=m.in_features, slice_offsets=m.offsets, max_rank=m.max_rank,
                           ranks_cpu=tuple(ranks), scalings_cpu=scalings, a_views=tuple(a_views),
                           b_views=tuple(b_views), dtype=m.dtype, device=m.device, keepalive=tuple(slots))

    def _pool_lookup(self, t: torch.Tensor) -> LoRAWeights | None:
        m = self.pool_modules.get(t.data_ptr()) if self.pool_modules else None
        if m is None:
            return None
        w = self._pool_weights.get((m.layer, m.module))
        if w is None:
            raise RuntimeError("LoRA op on a pool placeholder before bind_pool (the prepare_lora_batch hook is off?)")
        return w

    def forward_with_base(self, layer, x, base_fn, lora_a, lora_b, output_offset, offsets, *, all_reduce=None,
                          kind="linear", pruned_batch_info=None):
        if all_reduce is not None or pruned_batch_info is not None:
            return super().forward_with_base(layer, x, base_fn, lora_a, lora_b, output_offset, offsets,
                                             all_reduce=all_reduce, kind=kind, pruned_batch_info=pruned_batch_info)
        return self._lora(x, lora_a, lora_b, tuple(int(o) for o in offsets), base_fn())

    def run_lora_a_sgemm(self, x: torch.Tensor, weights: torch.Tensor, stack_num: int = 1, *args, **kwargs):
        slots, rows, _ = weights.shape
        t = torch.zeros(x.shape[0], rows, dtype=torch.float32, device=x.device)
        if rows:
            w = self._pool_lookup(weights) or self._weights(weights, None, tuple(range(0, stack_num + 1)))
            (lora_shrink if self.impl == "triton" else lora_shrink_ref)(x.contiguous(), t, self.meta, w)
        return t.to(x.dtype)

    def run_lora_b_sgemm(self, x: torch.Tensor, weights: torch.Tensor, output_offset_cpu=None,
                         base_output: torch.Tensor | None = None, *args, **kwargs):
        offsets = (0, weights.shape[1]) if output_offset_cpu is None else tuple(int(o) for o in output_offset_cpu)
        y = base_output
        if y is None:
            y = torch.zeros(x.shape[0], offsets[-1], dtype=weights.dtype, device=x.device)
        if weights.shape[-1]:
            w = self._pool_lookup(weights) or self._weights(None, weights, offsets)
            (lora_expand if self.impl == "triton" else lora_expand_ref)(x.float().contiguous(), y, self.meta, w)
        return y

    def run_qkv_lora(self, x, qkv_lora_a, qkv_lora_b, output_offset=None, output_offset_cpu=None,
                     max_qkv_out_dim=None, base_output=None, n_slices: int = 3, *args, **kwargs):
        if not isinstance(qkv_lora_b, torch.Tensor):
            raise TypeError("--lora-backend multilora needs qkv_lora_b as one stacked tensor")
        offsets = _offsets(output_offset_cpu, output_offset)
        return self._lora(x, qkv_lora_a, qkv_lora_b, offsets, base_output)

    def run_gate_up_lora(self, x, gate_up_lora_a, gate_up_lora_b, output_offset=None, output_offset_cpu=None,
                         base_output=None, *args, **kwargs):
        if output_offset_cpu is None and output_offset is None:
            half = gate_up_lora_b.shape[-2] // 2
            offsets = (0, half, 2 * half)
        else:
            offsets = _offsets(output_offset_cpu, output_offset)
        return self._lora(x, gate_up_lora_a, gate_up_lora_b, offsets, base_output)

    def run_lora_a_embedding(self, *args, **kwargs):
        raise NotImplementedError("--lora-backend multilora does not apply LoRA to embeddings; use triton/csgmv")

    def validate_lora_targets(self, base_model: torch.nn.Module, target_modules: set[str]) -> None:
        bad = sorted(t for t in target_modules if any(u in t for u in _UNSUPPORTED_TARGETS))
        if bad:
            raise ValueError(f"--lora-backend multilora does not support LoRA on {bad}; "
                             "drop them from --lora-target-modules or use --lora-backend triton")


@dataclass(frozen=True)
class PoolModule:
    """One SGLang LoRA module whose weights the pool holds: its layer and target name, its placeholders' data_ptrs,
    its input width, output slice offsets, the server's maximum rank (the shrink output's column stride), dtype and
    device."""

    layer: int
    module: str
    a_ptr: int
    b_ptr: int
    in_features: int
    offsets: tuple[int, ...]
    max_rank: int
    dtype: torch.dtype
    device: torch.device


def _max_step_tokens(server_args) -> int:
    """The most tokens SGLang plans to put in one eager step (a prefill chunk, or a whole prefill
    when chunking is off); 0 without server args. A larger step (a mixed chunk) grows the layout."""
    names = ("chunked_prefill_size", "max_prefill_tokens")
    sizes = [getattr(server_args, name, None) for name in names]
    return max((s for s in sizes if isinstance(s, int) and s > 0), default=0)


def _num_tokens(forward_batch) -> int:
    mode = forward_batch.forward_mode
    if mode.is_target_verify():
        return forward_batch.batch_size * forward_batch.spec_info.draft_token_num
    if mode.is_extend():
        return int(sum(forward_batch.extend_seq_lens_cpu))
    if mode.is_idle():
        return 0
    return forward_batch.batch_size


def _offsets(cpu, dev) -> tuple[int, ...]:
    src = cpu if cpu is not None else dev
    return tuple(int(o) for o in src.tolist())


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def register() -> None:
    """Registers the backend in SGLang's LoRA backend registry. Idempotent."""
    from sglang.srt.lora.backend import lora_registry

    if NAME not in lora_registry.LORA_SUPPORTED_BACKENDS:
        lora_registry.register_lora_backend(NAME)(lambda: MultiLoRABackend)


def add_cli_choice(parser) -> None:
    """Adds `multilora` to `--lora-backend`'s choices (SGLang's field lists its own backends only)."""
    for action in parser._actions:
        if "--lora-backend" in action.option_strings and action.choices is not None and NAME not in action.choices:
            action.choices = [*action.choices, NAME]

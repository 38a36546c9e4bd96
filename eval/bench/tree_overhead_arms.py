"""The arms of `tree_overhead.py` and the loop that drives them: SGLang's real memory objects on the CPU, a prefix
cache over them, and real `Req`s taken through SGLang's own cache functions the way its scheduler calls them.
Not here: the request stream, the repeats and the report (`tree_overhead.py`).

Each arm owns a `ReqToTokenPool`, an `MHATokenToKVPool` (1 layer, 1 head of dim 8: the buffers are not the point)
and a token allocator of `kv_tokens` slots, and one cache:
- `stock`: SGLang's `RadixCache`; a request's adapter is its `extra_key` (`Req(lora_id=...)` makes it so);
- `ours`: `MultiLoRARadixCache` (`--radix-cache-backend multilora --multilora-stock-baseline memory`), requests built
  through the strict ingress hook as in the server;
- `ours:unified`: the same over `UnifiedTokenAllocator` (the default with the tree): adapters take KV slots,
  made resident at admission by `LiveMemory` and evicted with the KV; the plugin's admission hooks are called
  where the scheduler calls them (arrival, before / during / after each admission pass, after each step).

One step of `Driver.step` is one scheduler iteration (a window of at most `window` requests in flight):
  admission pass: for each arrived request, while the window has room and its prompt + output fits in
    available + evictable minus the running requests' remaining output (PrefillAdder's budget, without
    prefix credit): `init_next_round_input` (`match_kv_cache`), `extend_end`, `req.lock = cache.lock(last_node)`;
  prefill (if any were admitted): `prefix_device_indices`, `alloc_req_slots`, `alloc_token_slots` (which evicts
    through `evict_from_tree_cache` when short), the `req_to_token` rows (`write_cache_indices`' CPU branch);
    [forward: the first output token]; `checkpoint_kv_cache`, or `release_kv_cache` if the request is done;
  otherwise decode: `alloc_token_slots` for `decode_chunk` tokens per running request, their rows;
    [forward: the tokens]; `release_kv_cache(req, cache, checkpoint=True)` for the finished ones.
Only the cache work is timed (perf_counter around each call; the bracketed forward work is not): a request's
own calls are charged to it, a batch's calls are split evenly over the batch.
"""

from __future__ import annotations

import time
import warnings
from array import array
from collections import deque
from contextlib import contextmanager

import torch

from eval.bench.pool_cost import radix_cache_nodes

KV_HEADS, KV_HEAD_DIM, KV_LAYERS = 1, 8, 1
ADAPTER_HIDDEN = 104  # rank r takes 2 * r * 104 / 16 = 13 r slots: a Llama-3-8B q/k/v/o adapter in its KV tokens
MAX_CONTEXT = 16384


def setup_sglang() -> None:
    """CPU fixes, then SGLang's runtime context as its own mem_cache tests publish it (read by the release path's
    `get_spec()` / `get_serving()`). Keeps a context someone already published."""
    from sgl_multilora.patches import cpu_compat

    cpu_compat.install()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sglang.srt.runtime_context import get_spec, publish
        from sglang.srt.server_args import ServerArgs

        try:
            get_spec()
        except ValueError:  # nothing published yet
            publish(ServerArgs(model_path="dummy", device="cpu"), role="tokenizer")


class _EvictionCounter:
    """Stands in for SGLang's metrics collector: every cache reports its evictions to it (`update_eviction_metrics`)."""

    def __init__(self) -> None:
        self.num_tokens = 0
        self.num_calls = 0

    def observe_eviction_duration(self, seconds: float) -> None:
        self.num_calls += 1

    def increment_eviction_num_tokens(self, num_tokens: int) -> None:
        self.num_tokens += num_tokens


@contextmanager
def registered_adapters(lora_ids: list[str], ranks: list[int]):
    """The adapters as the LoRA manager hooks register them (spec and host weights), removed afterwards; the
    process's `memory` is restored too (a unified cache installs its own)."""
    from sgl_multilora.patches.state import process_state

    from sgl_multilora.adapters import AdapterSpec, LoadedAdapter

    state = process_state()
    memory_before = state.memory
    g = torch.Generator().manual_seed(0)
    for i, (lid, rank) in enumerate(zip(lora_ids, ranks)):
        spec = AdapterSpec(f"a{i}", f"/adapters/a{i}", f"bench-identity-{i}", rank, 2.0 * rank, 2.0, ("q_proj",), None)
        weights = {(0, "q_proj"): (torch.randn(rank, ADAPTER_HIDDEN, generator=g),
                                   torch.randn(ADAPTER_HIDDEN, rank, generator=g))}
        state.adapters.stage(lid, LoadedAdapter(spec, weights))
        state.adapters.add(lid, spec)
    try:
        yield
    finally:
        for lid in lora_ids:
            state.adapters.remove(lid)
        state.memory = memory_before


def build_arm(arm: str, kv_tokens: int, window: int):
    """(cache, req_to_token_pool, allocator) for `arm` over fresh SGLang memory objects."""
    from sgl_multilora.patches.radix_backend import MultiLoRARadixCache
    from sgl_multilora.patches.unified_memory import UnifiedTokenAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache

    kv = MHATokenToKVPool(kv_tokens, 1, torch.float32, KV_HEADS, KV_HEAD_DIM, KV_LAYERS, "cpu", False)
    allocator_cls = UnifiedTokenAllocator if arm == "ours:unified" else TokenToKVPoolAllocator
    allocator = allocator_cls(kv_tokens, torch.float32, "cpu", kv, False)
    req_pool = ReqToTokenPool(window, MAX_CONTEXT, "cpu", False)
    params = CacheInitParams(disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator,
                             page_size=1)
    if arm == "stock":
        cache = RadixCache(params)
    elif arm in ("ours", "ours:unified"):
        cache = MultiLoRARadixCache(params, model_id="bench-model")
    else:
        raise ValueError(f"unknown arm {arm!r}: stock, ours or ours:unified")
    cache.metrics_collector = _EvictionCounter()
    return cache, req_pool, allocator


class Driver:
    """Runs one arm over a stream of (adapter index, prompt, prompt + output) as SGLang's scheduler would."""

    def __init__(self, arm: str, kv_tokens: int, lora_ids: list[str], window: int, decode_chunk: int) -> None:
        from sgl_multilora.patches import ingress
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
        from sglang.srt.mem_cache import allocation, common
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.sampling.sampling_params import SamplingParams

        self.arm, self.kv_tokens, self.lora_ids = arm, kv_tokens, lora_ids
        self.window, self.decode_chunk = window, decode_chunk
        self.cache, self.req_pool, self.allocator = build_arm(arm, kv_tokens, window)
        self.memory = getattr(self.cache, "memory", None)
        self._req, self._finish, self._params = Req, FINISH_LENGTH, SamplingParams
        self._req_init = None if arm == "stock" else ingress.req_init
        self._alloc, self._common, self._modes = allocation, common, (ForwardMode.EXTEND, ForwardMode.DECODE)
        self.waiting: deque = deque()  # (index, req, output tokens)
        self.running: list = []
        self.seconds: list[float] = []  # per stream request: cache work charged to it
        self.phase_seconds: dict[str, float] = {}  # the timed requests' work by phase
        self.prompt_tokens = self.hit_tokens = 0
        self.timed_from = 0  # stream index from which hits count

    # ---- requests -------------------------------------------------------------------------------------------

    def arrive(self, index: int, adapter: int, prompt: list[int], full: list[int]) -> None:
        """A request joins the waiting queue (building the `Req` is the tokenizer's work: not timed)."""
        assert len(full) <= MAX_CONTEXT, f"request {index} has {len(full)} tokens, the row holds {MAX_CONTEXT}"
        args = (f"r{index}", "", array("q", prompt), self._params(max_new_tokens=len(full) - len(prompt)))
        lora_id = self.lora_ids[adapter]
        if self._req_init is None:
            req = self._req(*args, lora_id=lora_id)
        else:
            req = self._req.__new__(self._req)
            self._req_init(self._req.__init__, req, *args, lora_id=lora_id)
        self.seconds.append(0.0)
        if self.memory is not None:  # admission.add_request_to_queue: a visit for the eviction policy
            start = time.perf_counter()
            self.memory.record_request(self.memory_identity(lora_id))
            self._charge([index], time.perf_counter() - start, "pass")
        self.waiting.append((index, req, full[len(prompt):]))

    def memory_identity(self, lora_id: str) -> str:
        from sgl_multilora.patches.state import process_state

        return process_state().adapters.identity(lora_id)

    def _charge(self, indices: list[int], seconds: float, phase: str) -> None:
        share = seconds / len(indices)
        num_timed = sum(i >= self.timed_from for i in indices)
        self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + share * num_timed
        for i in indices:
            self.seconds[i] += share

    # ---- one scheduler iteration ------------------------------------------------------------------------------

    def step(self) -> None:
        new = self._admit()
        if new:
            self._prefill(new)
        elif self.running:
            self._decode()
        elif self.waiting:
            raise RuntimeError(f"{self.arm}: nothing runs and request {self.waiting[0][1].rid} cannot be admitted "
                               f"({self.kv_tokens} KV slots)")

    def _admit(self) -> list:
        """One admission pass (every iteration, as SGLang's `get_new_batch_prefill`, whose hooks run even when
        nothing can be admitted). Returns the admitted requests, matched and locked."""
        cache, mem, new = self.cache, self.memory, []
        start = time.perf_counter()
        if mem is not None:  # admission.get_new_batch_prefill, before the pass
            mem.before_prefill_pass([f[1] for f in self.running], {w[1].rid for w in self.waiting})
            mem.set_wanted([w[1] for w in self.waiting])
        pass_seconds = time.perf_counter() - start
        if self.waiting and len(self.running) < self.window:
            start = time.perf_counter()
            reserved = sum(len(out) - len(req.output_ids) for _, req, out in self.running)
            budget = self.allocator.available_size() + cache.evictable_size() - reserved
            pass_seconds += time.perf_counter() - start
        while self.waiting and len(self.running) + len(new) < self.window:
            index, req, out = self.waiting[0]
            t0 = time.perf_counter()
            need = len(req.origin_input_ids) + len(out)
            admitted = need <= budget
            if admitted and mem is not None:  # admission.can_schedule_lora_req
                identity = self.memory_identity(req.lora_id)
                admitted = mem.admit(req.rid, identity, budget)
                if admitted:
                    mem.residency.acquire(identity)
            if admitted:
                req.init_next_round_input(cache)  # match_kv_cache
                req.extend_end = len(req.full_untruncated_fill_ids)
                req.lock = cache.lock(req.last_node)
                budget -= need
            self._charge([index], time.perf_counter() - t0, "admission")
            if not admitted:
                break  # first come, first served: later requests wait too
            self.waiting.popleft()
            new.append((index, req, out))
            if index >= self.timed_from:
                self.prompt_tokens += len(req.origin_input_ids)
                self.hit_tokens += req.prefix_len
        start = time.perf_counter()
        if mem is not None:  # after the pass: running adapters read off the batches
            mem.set_running([f[1] for f in self.running + new])
        pass_seconds += time.perf_counter() - start
        if new or self.running:
            self._charge([f[0] for f in (new or self.running)], pass_seconds, "pass")
        return new

    def _prefill(self, new: list) -> None:
        cache, pool = self.cache, self.req_pool
        reqs = [req for _, req, _ in new]
        start = time.perf_counter()
        prefixes = [cache.prefix_device_indices(r) if r.prefix_len else None for r in reqs]
        self._alloc.alloc_req_slots(pool, reqs, cache)
        extend_lens = [r.extend_end - r.prefix_len for r in reqs]
        out_cache_loc = self._alloc.alloc_token_slots(cache, sum(extend_lens))
        pt = 0
        for r, prefix, n in zip(reqs, prefixes, extend_lens):
            if prefix is not None:
                pool.write((r.kv.req_pool_idx, slice(0, r.prefix_len)), prefix)
            pool.write((r.kv.req_pool_idx, slice(r.prefix_len, r.extend_end)), out_cache_loc[pt:pt + n])
            pt += n
            r.kv.kv_allocated_len = r.kv.kv_committed_len = r.extend_end
            cache.maybe_hand_to_session(r)
        self._charge([f[0] for f in new], time.perf_counter() - start, "extend_alloc")
        self.running.extend(new)
        for _, req, out in new:  # forward: the first output token
            req.output_ids.append(out[0])
        for index, req, out in new:
            start = time.perf_counter()
            if len(req.output_ids) == len(out):
                self._release(req, len(out))
            else:
                self._common.checkpoint_kv_cache(req, cache)
            self._charge([index], time.perf_counter() - start, "checkpoint")
        self._after_step(new, sum(extend_lens))
        self.running = [f for f in self.running if not f[1].finished()]

    def _decode(self) -> None:
        cache, pool = self.cache, self.req_pool
        chunks = [min(self.decode_chunk, len(out) - len(req.output_ids)) for _, req, out in self.running]
        start = time.perf_counter()
        out_cache_loc = self._alloc.alloc_token_slots(cache, sum(chunks))
        pt = 0
        for (_, req, _), k in zip(self.running, chunks):
            at = req.kv.kv_committed_len
            pool.write((req.kv.req_pool_idx, slice(at, at + k)), out_cache_loc[pt:pt + k])
            req.kv.kv_allocated_len += k
            req.kv.kv_committed_len += k
            pt += k
        self._charge([f[0] for f in self.running], time.perf_counter() - start, "decode_alloc")
        for (_, req, out), k in zip(self.running, chunks):  # forward: k more tokens
            n = len(req.output_ids)
            req.output_ids.extend(out[n:n + k])
        for index, req, out in self.running:
            if len(req.output_ids) == len(out):
                start = time.perf_counter()
                self._release(req, len(out))
                self._charge([index], time.perf_counter() - start, "release")
        self._after_step(self.running, 0)
        self.running = [f for f in self.running if not f[1].finished()]

    def _release(self, req, num_output: int) -> None:
        req.finished_reason = self._finish(length=num_output)
        self._common.release_kv_cache(req, self.cache, checkpoint=True)

    def _after_step(self, batch: list, extend_num_tokens: int) -> None:
        """admission.process_batch_result, after SGLang's own (checkpoints and releases done)."""
        if self.memory is None:
            return
        from types import SimpleNamespace

        mode = self._modes[0] if extend_num_tokens else self._modes[1]
        sglang_batch = SimpleNamespace(reqs=[f[1] for f in batch], extend_num_tokens=extend_num_tokens,
                                       forward_mode=mode)
        start = time.perf_counter()
        self.memory.after_step(sglang_batch)
        self._charge([f[0] for f in batch], time.perf_counter() - start, "pass")

    # ---- the end of the stream ------------------------------------------------------------------------------

    def drain(self) -> None:
        """Runs until every request is released, then one idle pass (the scheduler's loop goes on: the pass's
        hooks see that nothing runs; not charged to any request)."""
        while self.waiting or self.running:
            self.step()
        self._admit()

    def num_nodes(self) -> int:
        if self.arm != "stock":
            return self.cache.tree.stats().num_kv_nodes
        return radix_cache_nodes(self.cache)

    def num_locked_nodes(self) -> int:
        if self.arm != "stock":
            return self.cache.tree.protected_len()
        count, stack = 0, list(self.cache.root_node.children.values())
        while stack:
            node = stack.pop()
            count += node.lock_ref > 0
            stack.extend(node.children.values())
        return count

    def evictions(self) -> dict:
        """KV tokens evicted so far (for the unified arm also adapters evicted and loaded, and their slots)."""
        if self.arm == "stock":
            return {"kv_tokens": self.cache.metrics_collector.num_tokens}
        out = {"kv_tokens": self.cache.tree.stats().num_evicted_tokens}
        if self.memory is not None:
            c = self.memory.swapper.counters
            out |= {"adapters": c.adapter_evictions, "adapter_slots": c.adapter_evicted_slots,
                    "adapter_loads": c.adapter_loads + c.prefetches}
        return out

    def accounting(self) -> dict:
        """Where the pool's slots are once nothing runs: free, in the tree, adapters (unified only)."""
        adapter = self.allocator.pool.num_of("adapter") if self.memory is not None else 0
        return {"available": int(self.allocator.available_size()), "tree_tokens": int(self.cache.total_size()),
                "adapter_slots": adapter, "pool_slots": self.kv_tokens}


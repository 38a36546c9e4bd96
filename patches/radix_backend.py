"""`--radix-cache-backend multilora`: SGLang's prefix cache backed by the LoRA-aware tree (`sgl_multilora.tree`).

The class keeps SGLang's request-level contract (match on admission, `checkpoint` after each extend and on
finish, locks held through `req.lock`, eviction when the KV allocator runs short) and translates every call into
a structured `MatchKey`: namespace = (served model, cache_salt, the client's own extra_key), adapter = the
content identity of the request's adapter, aLoRA activation start k from the adapter's invocation tokens. The
request's `extra_key` string (encoded by `ingress.py`) is decoded for the client's part and never used as a key.
"""

from __future__ import annotations

import logging
import time

import torch
from sgl_multilora.patches import flags, lora_pool_layers
from sgl_multilora.patches.host_kv import LiveHostTier
from sgl_multilora.patches.ingress import decode_extra_key
from sgl_multilora.patches.state import process_state
from sgl_multilora.patches.unified_memory import LiveMemory, UnifiedTokenAllocator
from sglang.srt.mem_cache.base_prefix_cache import (
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InitLoadBackParams,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.radix_cache import RadixCache

from sgl_multilora.adapters import AdapterSpec, find_invocation_start
from sgl_multilora.keys import AdapterRef, MatchKey, Namespace
from sgl_multilora.tree import LoraRadixTree
from sgl_multilora.tree_nodes import Node, NodeKind, TreeStats

logger = logging.getLogger(__name__)

BACKEND_NAME = "multilora"
STATS_LOG_INTERVAL_S = 10.0
MAX_NAMESPACES = 4096  # decoded (extra_key, cache_salt) pairs kept


class MultiLoRARadixCache(RadixCache):
    """A `RadixCache` whose tree is a `LoraRadixTree`. Nodes handed to SGLang are the tree's `Node`s."""

    def __init__(self, params, *, model_id: str):
        self.model_id = model_id
        self.adapters = process_state().adapters  # the process's adapter owner: lora_id -> spec
        self._last_stats_log = time.monotonic()
        self._adapter_refs: dict[str, AdapterRef] = {}  # identity -> its (immutable) key object
        self._namespaces: dict[tuple, Namespace] = {}  # (req.extra_key, cache_salt) -> its decoded Namespace
        self.memory: LiveMemory | None = None
        self.host: LiveHostTier | None = None
        super().__init__(params)
        allocator = self.token_to_kv_pool_allocator
        if isinstance(allocator, UnifiedTokenAllocator):
            self.memory = LiveMemory(allocator, self.tree, waiting_key=self.waiting_key,
                                     req_to_token_pool=self.req_to_token_pool)
            state = process_state()
            for lora_id, adapter in state.adapters.loaded_items():
                self.memory.register(lora_id, adapter)
            state.memory = self.memory
            host_kv_gb = flags.current().host_kv_gb
            if host_kv_gb > 0:
                self.host = self.memory.host = LiveHostTier(self.memory, host_kv_gb * 1e9)
            logger.info("sgl_multilora: %s", self.memory.capacity_line())
        lora_pool_layers.check_memory(self.memory)

    # ---- keys -------------------------------------------------------------------------------------------------

    def _namespace(self, extra_key: str | None, cache_salt: str | None) -> Namespace:
        return Namespace(base_model=self.model_id, cache_salt=cache_salt, extra_key=extra_key or None)

    def _req_namespace(self, extra_key: str | None, cache_salt: str | None) -> Namespace:
        """The namespace of a request's encoded `extra_key` and salt: a pure function of the two strings (and the
        served model), so decoded once per pair; the table is cleared when it grows past MAX_NAMESPACES."""
        pair = (extra_key, cache_salt)
        namespace = self._namespaces.get(pair)
        if namespace is None:
            if len(self._namespaces) >= MAX_NAMESPACES:
                self._namespaces.clear()
            client_extra_key, _ = decode_extra_key(extra_key)  # the adapter comes from lora_id, resolved by the caller
            namespace = self._namespaces[pair] = self._namespace(client_extra_key, cache_salt)
        return namespace

    def _key_for_req(self, req, token_ids) -> MatchKey:
        """The tree key of `req` over `token_ids` (any int sequence; the tree copies what it keeps)."""
        lora_id = getattr(req, "lora_id", None)
        namespace = self._req_namespace(req.extra_key, req.cache_salt)
        if lora_id is None:
            return MatchKey(namespace, None, token_ids)
        spec = self.adapters.spec(lora_id)
        if spec is None:
            raise RuntimeError(f"request {req.rid} names LoRA id {lora_id}, which is not loaded")
        return self.key_for(namespace, spec, token_ids, req.origin_input_ids)

    def waiting_key(self, req) -> MatchKey | None:
        """The tree key of the prefix a waiting request will match when admitted (its prompt and any output a
        retraction left), or None when it will match nothing (its adapter was unloaded, embedding overrides)."""
        if getattr(req, "positional_embed_overrides", None) is not None:
            return None
        if req.lora_id is not None and self.adapters.spec(req.lora_id) is None:
            return None
        tokens = req.origin_input_ids if not req.output_ids else [*req.origin_input_ids, *req.output_ids]
        return self._key_for_req(req, tokens)

    def cached_len(self, req) -> int:
        """Tokens of a waiting request's prefix the tree holds now (a pure query: no access recorded)."""
        key = self.waiting_key(req)
        return 0 if key is None else self.tree.match(key, touch=False).prefix_len

    def key_for(self, namespace: Namespace, spec: AdapterSpec | None, token_ids, prompt_ids) -> MatchKey:
        """The tree key of `token_ids` under `namespace` for adapter `spec` (None: the base model); an aLoRA's
        activation start is found in `prompt_ids`, the request's prompt."""
        if spec is None:
            return MatchKey(namespace, None, token_ids)
        adapter = self._adapter_refs.get(spec.identity)
        if adapter is None:
            adapter = self._adapter_refs[spec.identity] = AdapterRef(identity=spec.identity, name=spec.name)
        if not spec.is_alora:
            return MatchKey(namespace, adapter, token_ids)
        k = find_invocation_start(prompt_ids, spec.alora_invocation_tokens)
        if k is None:  # the adapter never activates: every token is base KV
            return MatchKey(namespace, None, token_ids)
        return MatchKey(namespace, adapter, token_ids, alora_start=k)

    def namespace_for(self, extra_key: str | None, cache_salt: str | None) -> Namespace:
        """The namespace of a client's own `extra_key` and `cache_salt` (not the encoded request field)."""
        return self._namespace(extra_key, cache_salt)

    def _key_without_req(self, key) -> MatchKey:
        """Key of a bare `RadixKey` (SGLang's in-batch heuristics pass no request): its namespace and adapter come
        from the encoded extra_key. Without the request an aLoRA's activation start is unknown, so such a key
        stays at the aLoRA's adapter node, which holds no KV: it matches nothing rather than guessing."""
        client_extra_key, identity = decode_extra_key(key.extra_key)
        namespace = self._namespace(client_extra_key, key.cache_salt)
        adapter = None
        if identity is not None:
            adapter = self._adapter_refs.get(identity) or AdapterRef(identity=identity, name=None)
        return MatchKey(namespace, adapter, key.raw_token_ids())

    # ---- tree-level API -------------------------------------------------------------------------------------

    def reset(self):
        super().reset()
        self.tree = LoraRadixTree(page_size=self.page_size)
        memory = getattr(self, "memory", None)
        if memory is not None:  # a flush: the same adapters and pool, a new tree
            memory.swapper.tree = self.tree
            self.tree.score = memory.policy
        host = getattr(self, "host", None)
        if host is not None:  # a flush empties the host tier too
            host.clear()
        self.root_node = self.tree.root
        self._empty_match_result = MatchResult(
            device_prefix_len=0,
            last_device_node=self.root_node,
            last_host_node=self.root_node,
            best_match_node=self.root_node,
        )

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        if self.disable or len(params.key) == 0:
            return self._empty_match_result
        req = params.req
        key = (self._key_for_req(req, params.key.raw_token_ids()) if req is not None
               else self._key_without_req(params.key))
        result = self.tree.match(key)
        self._maybe_log_stats()
        host_hit = 0
        if self.host is not None and req is not None:
            host_hit = self.host.host_hit(req.rid, key, result.prefix_len)
        return MatchResult(
            device_prefix_len=result.prefix_len,
            last_device_node=result.last_node,
            last_host_node=result.last_node,
            best_match_node=result.last_node,
            host_hit_length=host_hit,
        )

    def init_load_back(self, params: InitLoadBackParams):
        """SGLang admits a request whose match reported a host hit: copy it back (all of it) or nothing."""
        if self.host is None or params.req is None:
            return 0, params.best_match_node
        return self.host.load_back(params.req.rid, params.best_match_node, params.host_hit_length)

    def touch_prefix(self, key) -> None:
        return None  # access times are refreshed by match_prefix, which always carries the request

    def insert(self, params: InsertParams) -> InsertResult:
        # Only reached by callers without a request (none on the serving path): base KV of the key's namespace.
        if self.disable:
            return InsertResult(prefix_len=0)
        key = self._key_without_req(params.key)
        values = params.value.to(dtype=torch.int64, copy=True)  # the tree keeps slices of it (`value_cache`)
        result = self.tree.insert(key, values)
        if self.memory is not None:
            self.token_to_kv_pool_allocator.mark_cached(values[result.prefix_len:])
        return InsertResult(prefix_len=result.prefix_len, last_device_node=result.last_node)

    def checkpoint(self, req, *, up_to: int):
        if self.disable:
            return
        token_ids = req.full_untruncated_fill_ids[:up_to]
        aligned_len = len(token_ids) // self.page_size * self.page_size
        if aligned_len < len(token_ids):
            token_ids = token_ids[:aligned_len]
        kv_indices = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :aligned_len]
        # A private copy: the tree keeps slices of it as its nodes' `value_cache` (and lists of what it takes).
        values = kv_indices.to(dtype=torch.int64, copy=True)
        result = self.tree.insert(self._key_for_req(req, token_ids), values)
        if self.memory is not None:  # the rows the tree did not have are its own now
            self.token_to_kv_pool_allocator.mark_cached(values[result.prefix_len:])
        req.kv.cache_inserted_len = max(req.kv.cache_inserted_len, aligned_len)
        protected_len = req.kv.cache_protected_len
        # The tree kept its own slots for [0, prefix_len): free this request's duplicates past the protected part.
        self.token_to_kv_pool_allocator.free_segment(kv_indices[protected_len : result.prefix_len],
                                                     start_pos=protected_len)
        self.req_to_token_pool.write(
            (req.kv.req_pool_idx, slice(protected_len, aligned_len)),
            self._path_indices(result.last_node, protected_len, aligned_len),
        )
        req.kv.cache_protected_len = aligned_len
        self.unlock(req.lock)
        req.lock = self.lock(result.last_node)
        req.last_node = result.last_node

    def evict(self, params: EvictParams) -> EvictResult:
        if self.disable:
            return EvictResult()
        start = time.perf_counter()
        if self.memory is not None:
            num_evicted = self.memory.evict(params.num_tokens)
            self.update_eviction_metrics(num_evicted, start)
            return EvictResult(num_tokens_evicted=num_evicted)
        runs = []  # the evicted runs' slot ids, freed in one call (the free list comes out as if freed one by one)
        num_evicted = self.tree.evict(params.num_tokens, runs.append)
        if runs:
            self.token_to_kv_pool_allocator.free_segment(torch.cat([self._as_indices(r) for r in runs]), start_pos=0)
        self.update_eviction_metrics(num_evicted, start)
        return EvictResult(num_tokens_evicted=num_evicted)

    def inc_lock_ref(self, node: Node) -> IncLockRefResult:
        if self.disable:
            return IncLockRefResult(delta=0)
        before = self.tree.evictable_len()
        self.tree.lock(node)
        return IncLockRefResult(delta=self.tree.evictable_len() - before)

    def dec_lock_ref(self, node: Node, params=None) -> DecLockRefResult:
        if self.disable:
            return DecLockRefResult(delta=0)
        before = self.tree.evictable_len()
        self.tree.unlock(node)
        return DecLockRefResult(delta=self.tree.evictable_len() - before)

    def path_device_indices(self, node: Node) -> torch.Tensor:
        return self._path_indices(node, 0, None)

    def _path_indices(self, node: Node, start: int, end: int | None) -> torch.Tensor:
        """`path_device_indices(node)[start:end]`, concatenating only the runs that overlap it (each run's
        `value_cache`, so no list is converted). Asserts the path holds at least `end` tokens."""
        path = []
        while node is not None and node.kind is NodeKind.KV:
            path.append(node)
            node = node.parent
        path.reverse()
        runs, pos, first = [], 0, 0
        for n in path:
            run_end = pos + len(n.value)
            if run_end > start and (end is None or pos < end):
                if not runs:
                    first = pos
                runs.append(self._as_indices(n.value_cache if n.value_cache is not None else n.value))
            pos = run_end
        assert end is None or pos >= end, (pos, end)
        if not runs:
            return self._empty_device_indices
        indices = torch.cat(runs)
        if start == first and (end is None or end == pos):
            return indices
        return indices[start - first:(pos if end is None else end) - first]

    def _as_indices(self, values) -> torch.Tensor:
        """A run's slot ids as an int64 tensor: its `value_cache` as is, a list (a node inserted without one)
        converted."""
        if isinstance(values, torch.Tensor):
            return values
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def evictable_size(self):
        if self.memory is None:
            return self.tree.evictable_len()
        return self.tree.evictable_len() + self.memory.evictable_adapter_slots()

    def protected_size(self):
        if self.memory is None:
            return self.tree.protected_len()
        return self.tree.protected_len() + self.memory.pinned_slots()

    def total_size(self):
        return self.tree.total_len()

    def all_values_flatten(self):
        raise NotImplementedError("not used with the multilora backend")

    def multilora_stats(self) -> TreeStats:
        """The tree's counters (for /multilora/stats). Does not modify anything."""
        return self.tree.stats()

    def pretty_print(self):
        print(self.tree.stats())

    def check_invariants(self) -> None:
        """The tree's invariants plus SGLang's view: tree sizes agree with what it reports to the scheduler."""
        self.tree.check_invariants()
        assert self.tree.evictable_len() + self.tree.protected_len() == self.total_size()
        if self.memory is not None:
            self.memory.check_invariants()
        if self.host is not None:
            self.host.check_invariants()

    def _maybe_log_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_stats_log < STATS_LOG_INTERVAL_S:
            return
        self._last_stats_log = now
        s = self.tree.stats()
        logger.info(
            "multilora tree: hits %s, %d KV nodes / %d tokens (%d evictable, %d locked), %d adapters, "
            "evicted %d tokens",
            dict(s.hit_tokens), s.num_kv_nodes, s.total_len, s.evictable_len, s.protected_len,
            s.num_adapter_nodes, s.num_evicted_tokens,
        )
        if self.memory is not None:
            m = self.memory.stats()
            logger.info("multilora pool (MiB): %s; resident adapters %d/%d; swapper %s",
                        {k: round(v / 2**20, 2) for k, v in m["bytes"].items()},
                        m["adapters"]["resident"], m["adapters"]["registered"], m["swapper"])


def create(ctx) -> MultiLoRARadixCache:
    """Factory registered as `--radix-cache-backend multilora` (called in the scheduler process)."""
    unsupported = [
        ("hierarchical cache (--enable-hierarchical-cache)", ctx.enable_hierarchical_cache),
        ("hybrid sliding-window models", ctx.is_hybrid_swa),
        ("hybrid state-space models", ctx.is_hybrid_ssm),
    ]
    for what, present in unsupported:
        if present:
            raise ValueError(f"--radix-cache-backend {BACKEND_NAME} does not support {what} yet")
    return MultiLoRARadixCache(ctx.params, model_id=str(ctx.server_args.model_path))


def register() -> None:
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    if get_radix_cache_factory(BACKEND_NAME) is None:
        register_radix_cache_backend(BACKEND_NAME, create)

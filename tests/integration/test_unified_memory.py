"""The unified pool on SGLang's real KV buffers (`MHATokenToKVPool` on CPU): SGLang's allocator API over the core
pool, adapters copied into KV slots and read in place, KV written around them, eviction and accounting.

No server: these drive `UnifiedTokenAllocator` and `LiveMemory` with the core tree directly, as the scheduler's
hooks do, and check the bytes in SGLang's buffers.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from sgl_multilora.patches import cpu_compat
from sgl_multilora.patches.state import process_state

from sgl_multilora.adapters import AdapterSpec, LoadedAdapter
from sgl_multilora.keys import AdapterRef, MatchKey, Namespace
from sgl_multilora.pool import ExceedsPoolError
from sgl_multilora.tree import LoraRadixTree

SLOTS, HEADS, DIM, LAYERS = 96, 2, 8, 2  # one slot row: 16 elements per buffer per layer
NS = Namespace("m")


@pytest.fixture(scope="module")
def sglang_pool_classes():
    cpu_compat.install()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sgl_multilora.patches.unified_memory import LiveMemory, UnifiedTokenAllocator
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    return MHATokenToKVPool, UnifiedTokenAllocator, LiveMemory


def make_adapter(name: str, rank: int, seed: int) -> LoadedAdapter:
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(LAYERS):
        weights[(layer, "q_proj")] = (torch.randn(rank, 16, generator=g), torch.randn(16, rank, generator=g))
        weights[(layer, "up_proj")] = (torch.randn(rank, 16, generator=g), torch.randn(32, rank, generator=g))
    spec = AdapterSpec(name, f"/adapters/{name}", f"id-{name}", rank, 2.0 * rank, 2.0, ("q_proj", "up_proj"), None)
    return LoadedAdapter(spec, weights)


@pytest.fixture
def world(sglang_pool_classes):
    pool_cls, allocator_cls, memory_cls = sglang_pool_classes
    kv = pool_cls(SLOTS, 1, torch.float32, HEADS, DIM, LAYERS, "cpu", False)
    allocator = allocator_cls(SLOTS, torch.float32, "cpu", kv, False)
    clock = [0.0]
    tree = LoraRadixTree(clock=lambda: clock[0])
    memory = memory_cls(allocator, tree)
    registry = process_state().adapters
    adapters = {n: make_adapter(n, r, i) for i, (n, r) in enumerate([("a", 2), ("b", 4), ("c", 2)])}
    for name, adapter in adapters.items():
        registry.add(name, adapter.spec)
        memory.register(name, adapter)
    yield kv, allocator, tree, memory, adapters, clock
    for name in adapters:
        registry.remove(name)


def assert_weights_in_place(memory, adapter: LoadedAdapter) -> None:
    views = memory.weights(adapter.spec.identity)
    assert views is not None, f"{adapter.spec.name} is not resident"
    for key, (a, b) in adapter.weights.items():
        va, vb = views.weights[key]
        assert torch.equal(va, a) and torch.equal(vb, b), f"{adapter.spec.name} {key} differs from its host copy"
        for v in (va, vb):  # a view of SGLang's K or V buffer of that layer, not a copy
            bases = {t.untyped_storage().data_ptr() for t in (memory.k_buffers[key[0]], memory.v_buffers[key[0]])}
            assert v.untyped_storage().data_ptr() in bases


def test_sglang_allocator_api_over_the_pool(world):
    kv, allocator, tree, memory, adapters, clock = world
    assert allocator.available_size() == SLOTS
    ids = allocator.alloc(10)
    assert ids.tolist() == list(range(1, 11))  # SGLang's index 0 stays the padding slot
    assert allocator.available_size() == SLOTS - 10 and len(allocator.free_pages) == SLOTS - 10
    allocator.free(ids[:4])
    allocator.free_group_begin()
    allocator.free(ids[4:6])
    assert allocator.available_size() == SLOTS - 6  # held until the group ends
    allocator.free_group_end()
    assert allocator.available_size() == SLOTS - 4
    assert allocator.alloc(SLOTS) is None
    allocator.pool.check_invariants()


def test_adapters_are_copied_into_kv_slots_and_survive_kv_writes_around_them(world):
    kv, allocator, tree, memory, adapters, clock = world
    for name in ("a", "b"):
        assert memory.ensure_resident(adapters[name].spec.identity, budget=None)
    used = allocator.pool.num_of("adapter")
    assert used == sum(memory.residency.entry(f"id-{n}").num_slots for n in ("a", "b"))
    ids = allocator.alloc(allocator.available_size())  # every free slot becomes KV
    for layer in range(LAYERS):  # a forward pass writes K and V at those slots
        kv.k_buffer[layer][ids] = torch.randn(len(ids), HEADS, DIM)
        kv.v_buffer[layer][ids] = torch.randn(len(ids), HEADS, DIM)
    kv.k_buffer[0][0] = 7.0  # and the padding slot
    for name in ("a", "b"):
        assert_weights_in_place(memory, adapters[name])
    memory.check_invariants()


def test_eviction_keeps_the_dependency_rule_and_the_accounting(world):
    kv, allocator, tree, memory, adapters, clock = world
    ident = {n: a.spec.identity for n, a in adapters.items()}
    for t, name in enumerate(("a", "b")):
        clock[0] = float(t)
        memory.record_request(ident[name])
        assert memory.ensure_resident(ident[name], budget=None)
        values = allocator.alloc(2).tolist()  # the request's KV, then cached by the tree
        result = tree.insert(MatchKey(NS, AdapterRef(ident[name], name), [100 * t, 100 * t + 1]), values)
        allocator.mark_cached(values[result.prefix_len:])
        memory.check_invariants()
    # "c" (6 slots) needs room that the KV (2 + 2 slots) cannot give: an adapter goes too, after its own KV
    # (never an adapter with KV depending on it)
    clock[0] = 5.0
    allocator.alloc(allocator.available_size())  # running KV takes every free slot
    memory.set_running([])
    assert memory.ensure_resident(ident["c"], budget=None)
    assert memory.residency.is_resident(ident["c"]) and memory.swapper.invalid_kv_slots() == 0
    assert memory.swapper.counters.kv_evictions >= 1 and memory.swapper.counters.adapter_evictions >= 1
    assert_weights_in_place(memory, adapters["c"])
    for name in ("a", "b"):
        if memory.residency.is_resident(ident[name]):
            assert_weights_in_place(memory, adapters[name])
    memory.check_invariants()
    by_kind = allocator.pool.by_kind()
    assert sum(by_kind.values()) == SLOTS
    assert by_kind["kv_cached"] == tree.total_len()


def test_running_adapters_and_locked_kv_are_never_evicted(world):
    kv, allocator, tree, memory, adapters, clock = world
    ident = {n: a.spec.identity for n, a in adapters.items()}
    assert memory.ensure_resident(ident["a"], budget=None) and memory.ensure_resident(ident["b"], budget=None)

    class Req:
        def __init__(self, lora_id):
            self.lora_id = lora_id

    memory.set_running([Req("a"), Req("b")])
    allocator.alloc(allocator.available_size())
    assert not memory.ensure_resident(ident["c"], budget=None)  # not now: nothing may go
    assert memory.residency.is_resident(ident["a"]) and memory.residency.is_resident(ident["b"])
    assert memory.evictable_adapter_slots() == 0 and memory.pinned_slots() == allocator.pool.num_of("adapter")
    memory.set_running([Req("a")])
    assert memory.evictable_adapter_slots() == memory.residency.entry(ident["b"]).num_slots
    assert memory.ensure_resident(ident["c"], budget=None)  # b goes, a stays
    assert not memory.residency.is_resident(ident["b"]) and memory.residency.is_resident(ident["a"])
    memory.check_invariants()


def test_an_adapter_whose_kv_is_locked_is_not_reported_evictable(world):
    """What SGLang is told it could have back: a resident adapter counts until a lock (a running request's prefix)
    pins a KV node below it, in any namespace, and again once the lock is gone."""
    kv, allocator, tree, memory, adapters, clock = world
    b = adapters["b"].spec.identity
    assert memory.ensure_resident(b, budget=None)
    own = memory.residency.entry(b).num_slots
    for namespace in (NS, Namespace("other")):
        slots = allocator.alloc(4).tolist()
        result = tree.insert(MatchKey(namespace, AdapterRef(identity=b, name="b"), [1, 2, 3, 4]), slots)
        allocator.mark_cached(slots)
        assert memory.evictable_adapter_slots() == own
        tree.lock(result.last_node)
        assert memory.evictable_adapter_slots() == 0
        assert memory.pinned_slots() == allocator.pool.num_of("adapter")
        tree.unlock(result.last_node)
        assert memory.evictable_adapter_slots() == own
    memory.check_invariants()


def test_a_load_takes_no_more_than_the_budget_and_an_oversized_adapter_is_refused(world):
    kv, allocator, tree, memory, adapters, clock = world
    ident = adapters["b"].spec.identity
    n = memory.residency.entry(ident).num_slots
    assert not memory.ensure_resident(ident, budget=n - 1) and not memory.residency.is_resident(ident)
    assert memory.ensure_resident(ident, budget=n)
    huge = make_adapter("huge", 64, 9)
    with pytest.raises(ExceedsPoolError, match=r"LoRA adapter 'huge' takes \d+ token slots \(\d+ B\) of the pool's 96 .* no request on it could ever run"):
        memory.check_fits(huge)


def test_a_request_pins_an_idle_resident_adapter_only_within_the_pass_budget(world):
    """SGLang's prefill budget (free + `evictable_size` - what the pass reserved) counts an idle resident adapter
    as room it could evict. Pinning the adapter for a request takes that room away, so the hook's admission must
    refuse it when the requests admitted earlier in the pass reserved it: otherwise their extend allocation finds
    fewer slots than the budget promised and the scheduler stops with "Out of memory" (seen live, chatbot workload,
    24 adapters in a 6,000-slot pool)."""
    kv, allocator, tree, memory, adapters, clock = world
    b = adapters["b"].spec.identity
    assert memory.ensure_resident(b, budget=None)
    n = memory.residency.entry(b).num_slots

    def room() -> int:  # what SGLang's PrefillBudget reads as available + evictable
        return allocator.available_size() + tree.evictable_len() + memory.evictable_adapter_slots()

    memory.before_prefill_pass([], {"late", "base"})
    reserved = room() - (n - 1)  # an earlier request of the pass reserved all but n - 1 slots
    assert not memory.admit("late", b, budget=room() - reserved)
    assert room() >= reserved and memory.residency.num_running(b) == 0
    # As SGLang's own "no room": the pass takes no later request, and the refusal starts no starvation clock.
    assert not memory.admit("base", None, budget=room() - reserved)
    assert memory.stats()["budget_stops"] == 1 and memory.stats()["skipped_admissions"] == 0
    memory.before_prefill_pass([], {"late", "base"})  # the next pass: now the pin fits what is left
    reserved = room() - n
    assert memory.admit("late", b, budget=room() - reserved)
    memory.residency.acquire(b)  # as the hook does for an admitted request
    assert room() >= reserved
    assert memory.admit("another", b, budget=0)  # already pinned: a second request on it costs nothing more
    memory.check_invariants()


def test_unregister_removes_the_adapter_and_its_kv(world):
    kv, allocator, tree, memory, adapters, clock = world
    ident = adapters["a"].spec.identity
    assert memory.ensure_resident(ident, budget=None)
    values = allocator.alloc(8).tolist()
    tree.insert(MatchKey(NS, AdapterRef(ident, "a"), list(range(8))), values)
    allocator.mark_cached(values)
    memory.unregister("a", ident)
    assert ident not in memory.residency.ids() and tree.total_len() == 0
    assert allocator.pool.num_of("adapter") == 0 and allocator.available_size() == SLOTS
    memory.check_invariants()


def test_a_flush_returns_every_kv_slot_and_keeps_the_adapters(world):
    kv, allocator, tree, memory, adapters, clock = world
    assert memory.ensure_resident(adapters["a"].spec.identity, budget=None)
    allocator.alloc(20)
    allocator.clear()
    assert allocator.pool.num_of("kv_running") == 0
    assert allocator.available_size() == SLOTS - allocator.pool.num_of("adapter") > 0
    assert_weights_in_place(memory, adapters["a"])


def test_a_request_kept_out_too_long_holds_later_admissions_until_it_gets_in(world):
    kv, allocator, tree, memory, adapters, clock = world
    memory.gate.starvation_s = 0.0
    ident = {n: a.spec.identity for n, a in adapters.items()}
    running = allocator.alloc(allocator.available_size())  # running requests hold every slot
    assert not memory.admit("r1", ident["c"], budget=None)  # kept out: c cannot be made resident
    assert not memory.admit("r1", ident["c"], budget=None)  # ... for too long now
    assert not memory.admit("r2", None, budget=None) and not memory.admit("r3", ident["a"], budget=None)
    allocator.free(running)  # the running requests finish
    assert not memory.admit("r2", None, budget=None)  # still held for r1
    assert memory.admit("r1", ident["c"], budget=None)
    assert memory.admit("r2", None, budget=None)  # released
    assert memory.stats()["starvation_holds"] == 1


def test_host_tier_spills_prefetches_and_loads_back_the_same_bytes(world):
    """The host tier over the same buffers: KV the pool evicts is written to the host; the idle swap-in copies it
    back below the watermark; a promised host hit is loaded back into other slots; both with the original bytes."""
    from sgl_multilora.patches.host_kv import LiveHostTier

    kv, allocator, tree, memory, adapters, clock = world
    host = LiveHostTier(memory, capacity_bytes=40 * allocator.pool.slot_bytes)
    keys = [MatchKey(NS, None, list(range(100 * i, 100 * i + 12))) for i in range(3)]
    original = {}
    for key in keys:
        ids = allocator.alloc(12)
        for layer in range(LAYERS):
            kv.k_buffer[layer][ids] = torch.randn(12, HEADS, DIM)
            kv.v_buffer[layer][ids] = torch.randn(12, HEADS, DIM)
        tree.insert(key, ids.tolist())
        allocator.mark_cached(ids.tolist())
        original[tuple(key.token_ids)] = [(kv.k_buffer[layer][ids].clone(), kv.v_buffer[layer][ids].clone())
                                          for layer in range(LAYERS)]
    clock[0] = 1.0
    assert memory.evict(SLOTS) >= 36  # everything cached goes, through the swapper, to the host
    assert tree.total_len() == 0 and host.tier.used_tokens == 36
    memory.check_invariants()
    host.check_invariants()

    def assert_bytes(key):
        m = tree.match(key, touch=False)
        assert m.prefix_len == 12, m.prefix_len
        ids = torch.tensor(m.kv_values)
        for layer, (k, v) in enumerate(original[tuple(key.token_ids)]):
            assert torch.equal(kv.k_buffer[layer][ids], k) and torch.equal(kv.v_buffer[layer][ids], v)

    # A promised host hit (SGLang's init_load_back): exactly the promised tokens come back, as cached KV.
    device = tree.match(keys[0])
    assert host.host_hit("r0", keys[0], device.prefix_len) == 12
    loaded, node = host.load_back("r0", device.last_node, 12)
    assert loaded == 12 and not node.is_evicted
    assert_bytes(keys[0])
    assert allocator.pool.num_of("kv_cached") == tree.total_len() == 12
    # A promise that no longer holds (the host lost the run) loads nothing: SGLang recomputes.
    assert host.host_hit("r1", keys[1], 0) == 12
    host.clear()
    assert host.load_back("r1", tree.root, 12)[0] == 0 and host.num_declined == 1
    # A request aborted between its match and its admission: its promise is forgotten at the next pass.
    host.promised["gone"] = (keys[1], 0, 12)
    host.prune(waiting_rids={"still-waiting"})
    assert host.promised == {}
    # Refill the host and let the idle swap-in bring KV back below the watermark (0.7 of the pool).
    for key in keys[1:]:
        ids = allocator.alloc(12)
        tree.insert(key, ids.tolist())
        allocator.mark_cached(ids.tolist())
        original[tuple(key.token_ids)] = [(kv.k_buffer[layer][ids].clone(), kv.v_buffer[layer][ids].clone())
                                          for layer in range(LAYERS)]
    memory.evict(SLOTS)
    assert host.tier.used_tokens >= 24
    clock[0] = 2.0
    memory.swapper.tick(10.0)
    assert memory.swapper.counters.kv_prefetched_slots >= 24
    for key in keys[1:]:
        assert_bytes(key)
    memory.check_invariants()
    host.check_invariants()
    assert allocator.pool.num_of("kv_cached") == tree.total_len()


def test_adapters_of_waiting_requests_are_evicted_last(world):
    """The waiting queue's adapters go after every other candidate: here the least recently used adapter stays
    because a request for it waits, and the other one is evicted."""
    from types import SimpleNamespace

    kv, allocator, tree, memory, adapters, clock = world
    for t, name in ((1.0, "a"), (2.0, "b")):
        clock[0] = t
        memory.record_request(adapters[name].spec.identity)
        assert memory.ensure_resident(adapters[name].spec.identity, budget=None)
    clock[0] = 3.0
    memory.set_wanted([SimpleNamespace(lora_id="a"), SimpleNamespace(lora_id=None)])  # SGLang's Req: lora_id
    assert memory.evict(1) >= 1  # one slot more than free: one adapter has to go
    assert memory.residency.is_resident("id-a") and not memory.residency.is_resident("id-b")
    memory.check_invariants()


def test_kv_waiting_requests_would_reuse_is_evicted_last(world):
    """A queued request's cached prefix outlives fresher KV no request waits for: LRU alone would take the older
    run first. The prefixes are matched once per admission pass, at the first eviction that needs them."""
    from types import SimpleNamespace

    kv, allocator, tree, memory, adapters, clock = world
    ident = adapters["a"].spec.identity
    assert memory.ensure_resident(ident, budget=None)
    runs = {}
    for t, tokens in ((1.0, [1, 2, 3]), (2.0, [4, 5, 6])):
        clock[0] = t
        values = allocator.alloc(3).tolist()
        tree.insert(MatchKey(NS, AdapterRef(ident, "a"), tokens), values)
        allocator.mark_cached(values)
        runs[tokens[0]] = values
    allocator.alloc(allocator.available_size())  # running KV takes every free slot
    memory.set_running([SimpleNamespace(lora_id="a")])
    queued = SimpleNamespace(rid="q", lora_id="a", tokens=[1, 2, 3, 9], output_ids=[])  # the older run's next turn
    memory.waiting_key = lambda r: MatchKey(NS, AdapterRef(ident, "a"), r.tokens)
    memory.set_wanted([queued])
    clock[0] = 3.0
    assert memory.evict(3) == 3
    assert tree.match(MatchKey(NS, AdapterRef(ident, "a"), [1, 2, 3]), touch=False).prefix_len == 3
    assert tree.match(MatchKey(NS, AdapterRef(ident, "a"), [4, 5, 6]), touch=False).prefix_len == 0
    assert memory.evict(3) == 3  # wanted KV only goes last: it never keeps room from a request
    assert tree.total_len() == 0
    memory.check_invariants()


def test_room_without_a_running_request_is_what_retracting_it_gives_back(world):
    """The squash rule's terms (patches/live_scheduler.py): `room_without` for a running request equals the room
    after really releasing it (its tree lock, its use of its adapter, the KV only it holds), changes nothing, and
    tells whether an adapter that cannot be made resident now would be after the retraction."""
    kv, allocator, tree, memory, adapters, clock = world
    ident = {n: a.spec.identity for n, a in adapters.items()}
    entry = memory.residency.entry

    class Req:
        def __init__(self, lora_id):
            self.lora_id = lora_id

    assert memory.ensure_resident(ident["a"], budget=None) and memory.ensure_resident(ident["b"], budget=None)
    # R2 on "a": a 4-token prompt cached in the tree and locked by it, 3 slots of decode KV only it holds
    prompt = allocator.alloc(4).tolist()
    node = tree.insert(MatchKey(NS, AdapterRef(ident["a"], "a"), [1, 2, 3, 4]), prompt).last_node
    allocator.mark_cached(prompt)
    tree.lock(node)
    owned = allocator.alloc(3)
    memory.set_running([Req("a"), Req("b")])  # and a request on "b"; running KV takes every other slot
    allocator.alloc(allocator.available_size())
    room, need = memory.room(), memory.slots_to_start(ident["c"])
    assert room == 0 and need == entry(ident["c"]).num_slots + memory.swapper.headroom_slots > 0
    assert memory.slots_to_start(ident["a"]) == 0 and memory.slots_to_start(None) == 0
    assert not memory.ensure_resident(ident["c"], budget=None)  # blocked: nothing may go

    predicted = memory.room_without(ident["a"], node, len(owned))
    assert predicted == 4 + 3 + entry(ident["a"]).num_slots
    assert memory.room() == room and node.lock_ref == 1 and memory.residency.num_running(ident["a"]) == 1
    memory.set_running([Req("a"), Req("a"), Req("b")])  # another request on "a" keeps the adapter: KV only
    assert memory.room_without(ident["a"], node, len(owned)) == 4 + 3
    memory.set_running([Req("a"), Req("b")])
    memory.check_invariants()

    tree.unlock(node)  # the retraction itself, as SGLang's release_kv_cache and the next pass's counts do it
    allocator.free(owned)
    memory.set_running([Req("b")])
    assert memory.room() == predicted
    assert predicted >= need and memory.ensure_resident(ident["c"], budget=None)
    assert memory.residency.is_resident(ident["b"])  # still running
    memory.check_invariants()


def test_a_load_refused_for_scattered_kv_moves_the_kv_out_of_one_window(world):
    """Running requests' KV in every other slot: no eviction can free a run for an adapter's matrices (a locked or
    running slot sits in every window), so without moves the load is "not now". With moves allowed, the swapper
    moves the KV out of the cheapest window: the adapter goes in, nothing is evicted, and every request row and tree
    path still reads the same K and V bytes from SGLang's buffers."""
    kv, allocator, tree, memory, adapters, clock = world
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    rows = ReqToTokenPool(4, 128, "cpu", False)
    memory.req_to_token_pool = rows
    ident_b = adapters["b"].spec.identity
    every = allocator.alloc(SLOTS)  # KV in every slot, then every other slot freed: runs of one free slot
    for layer in range(LAYERS):
        kv.k_buffer[layer][every] = torch.randn(SLOTS, HEADS, DIM)
        kv.v_buffer[layer][every] = torch.randn(SLOTS, HEADS, DIM)
    allocator.free(every[1::2])
    # request R: a 6-token prompt the tree caches (locked by R), then its own decode KV; the prompt sits in the
    # top slots, where the cheapest window is (ties go high), so the tree's ids move too
    kept = torch.cat([every[0::2][-6:], every[0::2][:-6]])
    prompt, own = kept[:6].tolist(), kept[6:]
    node = tree.insert(MatchKey(NS, None, [7, 8, 9, 10, 11, 12]), torch.tensor(prompt)).last_node
    allocator.mark_cached(prompt)
    tree.lock(node)
    row = rows.free_slots.pop()
    rows.req_to_token[row, :len(kept)] = kept.to(torch.int32)
    before = [(kv.k_buffer[layer][kept].clone(), kv.v_buffer[layer][kept].clone()) for layer in range(LAYERS)]
    need = memory.residency.entry(ident_b).num_slots
    assert 1 < memory.min_run(ident_b) <= need <= allocator.available_size()

    memory.allow_kv_moves(False)  # as with --multilora-stock-baseline kv-moves
    assert not memory.ensure_resident(ident_b, budget=None)
    counters = memory.swapper.counters
    assert counters.refused_loads == 1 and counters.unreachable_runs == 1 and counters.kv_compactions == 0

    memory.allow_kv_moves(True)
    assert memory.ensure_resident(ident_b, budget=None)
    assert counters.kv_compactions >= 1 and 0 < counters.kv_moved_slots <= need
    assert counters.kv_evictions == 0 and allocator.pool.num_of("kv_running") == len(own)
    assert_weights_in_place(memory, adapters["b"])
    moved_row = rows.req_to_token[row, :len(kept)].long()
    assert not torch.equal(moved_row, kept), "nothing of the request's KV moved"
    path = memory.swapper.tree.match(MatchKey(NS, None, [7, 8, 9, 10, 11, 12])).last_node
    assert path is node and torch.equal(node.value_cache, moved_row[:6]) and node.value == moved_row[:6].tolist()
    assert node.value != prompt, "the cached prompt did not move"
    for layer, (k, v) in enumerate(before):
        assert torch.equal(kv.k_buffer[layer][moved_row], k) and torch.equal(kv.v_buffer[layer][moved_row], v)
    assert allocator.pool.by_kind()["kv_cached"] == tree.total_len() == 6
    tree.check_invariants()
    memory.check_invariants()

"""Cache namespaces of real SGLang `Req`s in SGLang's own `RadixCache` and in ours, with the strict ingress hook.

SGLang 0.5.23 keys a request's prefix by `extra_key + lora_id`, one string: a base request whose `extra_key` is an
adapter's id shares that adapter's KV (checked here as the control). With `ingress.req_init` (the AROUND hook on
`Req.__init__`) two requests share cached KV exactly when their (client extra_key, cache_salt, adapter content
identity) are equal: brute-force comparison of those triples is the oracle.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.runtime_context import get_parallel
from sglang.srt.sampling.sampling_params import SamplingParams

from eval.security.attacks import cache_attacks
from sgl_multilora.adapters import AdapterSpec
from sgl_multilora.patches import ingress
from sgl_multilora.patches.radix_backend import MultiLoRARadixCache
from sgl_multilora.patches.state import process_state

PROMPT = list(range(100, 164))
VICTIM_ID, OTHER_ID = "0f" * 16, "a1" * 16
IDENTITIES = {VICTIM_ID: "identity-victim", OTHER_ID: "identity-other", "c3" * 16: "identity-victim"}


@pytest.fixture(autouse=True)
def loaded_adapters():
    """The adapters as the LoRA manager hooks register them in the process's adapter owner."""
    registry = process_state().adapters
    for i, (lora_id, identity) in enumerate(IDENTITIES.items()):
        registry.add(lora_id, AdapterSpec(f"a{i}", "", identity, 8, 16.0, 2.0, ("q_proj",), None))
    yield
    for lora_id in IDENTITIES:
        registry.remove(lora_id)


def make_req(rid: str, *, lora_id=None, extra_key=None, cache_salt=None, strict=True) -> Req:
    """A real `Req`, built through the strict ingress hook (AROUND `Req.__init__`) unless `strict` is off."""
    args = (rid, "", array("q", PROMPT), SamplingParams(max_new_tokens=1))
    kwargs = dict(lora_id=lora_id, extra_key=extra_key, cache_salt=cache_salt)
    if not strict:
        return Req(*args, **kwargs)
    req = Req.__new__(Req)
    ingress.req_init(Req.__init__, req, *args, **kwargs)
    return req


def stock_hit(cache: RadixCache, victim: Req, attacker: Req) -> int:
    cache.insert(InsertParams(key=RadixKey(array("q", PROMPT), extra_key=victim.extra_key, cache_salt=victim.cache_salt),
                              value=torch.arange(len(PROMPT))))
    key = RadixKey(array("q", PROMPT), extra_key=attacker.extra_key, cache_salt=attacker.cache_salt)
    return cache.match_prefix(MatchPrefixParams(key=key)).device_prefix_len


def tree_cache() -> MultiLoRARadixCache:
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None, page_size=1)
    return MultiLoRARadixCache(params, model_id="m")


def tree_hit(cache: MultiLoRARadixCache, victim: Req, attacker: Req) -> int:
    cache.tree.insert(cache._key_for_req(victim, PROMPT), list(range(len(PROMPT))))
    return cache.tree.match(cache._key_for_req(attacker, PROMPT)).prefix_len


def attack_reqs(strict: bool) -> list[tuple[str, Req]]:
    out = []
    for attack in cache_attacks(VICTIM_ID, IDENTITIES[VICTIM_ID], "other", num_random=40):
        fields = dict(attack.fields)
        if "lora_id" in fields:  # a request that names the victim's id IS the victim's; refused at the HTTP layer
            continue
        lora_id = OTHER_ID if fields.pop("lora_path", None) else None
        out.append((attack.name, make_req("attacker", lora_id=lora_id, strict=strict, **fields)))
    return out


def test_stock_sglang_shares_an_adapters_kv_with_a_forged_extra_key():
    victim = make_req("victim", lora_id=VICTIM_ID, strict=False)
    attacker = make_req("attacker", extra_key=VICTIM_ID, strict=False)
    assert stock_hit(RadixCache.create_simulated(), victim, attacker) == len(PROMPT)


@pytest.mark.parametrize("cache_kind", ["sglang_radix", "multilora_tree"])
def test_no_attack_reaches_the_victims_kv(cache_kind):
    victim = make_req("victim", lora_id=VICTIM_ID)
    hits = {}
    for name, attacker in attack_reqs(strict=True):
        if cache_kind == "sglang_radix":
            hits[name] = stock_hit(RadixCache.create_simulated(), victim, attacker)
        else:
            hits[name] = tree_hit(tree_cache(), victim, attacker)
    assert len(hits) > 40
    assert not {n: h for n, h in hits.items() if h}, hits
    # Control: the victim's own next request hits, in both caches.
    again = make_req("victim-2", lora_id=VICTIM_ID)
    hit = stock_hit(RadixCache.create_simulated(), victim, again) if cache_kind == "sglang_radix" else tree_hit(
        tree_cache(), victim, again)
    assert hit == len(PROMPT)


PIECES = st.sampled_from(["", "a", "b", "ab", "|", "\0", '"', ",", "null", "mlora1:", VICTIM_ID, VICTIM_ID[:8],
                          VICTIM_ID[8:], "identity-victim"])
TEXT = st.lists(PIECES, max_size=3).map("".join)
NAMESPACE = st.tuples(st.one_of(st.none(), TEXT), st.one_of(st.none(), TEXT),
                      st.sampled_from([None, *IDENTITIES]))


@settings(max_examples=300, deadline=None)
@given(a=NAMESPACE, b=NAMESPACE)
def test_kv_is_shared_exactly_within_one_namespace(a, b):
    """(extra_key, cache_salt, lora_id) pairs; the oracle compares (extra_key, cache_salt, identity) as SGLang
    normalises them ("" is no key)."""

    def norm(ns):
        extra, salt, lora_id = ns
        return extra or None, salt or None, IDENTITIES.get(lora_id)

    ra = make_req("a", extra_key=a[0], cache_salt=a[1], lora_id=a[2])
    rb = make_req("b", extra_key=b[0], cache_salt=b[1], lora_id=b[2])
    expected = len(PROMPT) if norm(a) == norm(b) else 0
    assert stock_hit(RadixCache.create_simulated(), ra, rb) == expected
    assert tree_hit(tree_cache(), ra, rb) == expected


def test_unknown_adapter_is_finished_with_400_before_it_joins_a_batch():
    """`ingress.add_request_to_queue` on a real `Req`: an id the scheduler's LoRA manager does not hold ends the
    request (HTTP 400 naming it) and runs its one-token abort step on the base model; a loaded one passes."""
    scheduler = SimpleNamespace(tp_worker=SimpleNamespace(model_runner=SimpleNamespace(
        lora_manager=SimpleNamespace(lora_refs={VICTIM_ID: object()}))))
    queued = []
    unknown = make_req("unknown", lora_id="ff" * 16)
    with get_parallel().override(tp_rank=0):  # the abort logs on rank 0; no TP group exists in a test process
        ingress.add_request_to_queue(lambda self, req: queued.append(req), scheduler, unknown)
    assert queued == [unknown] and unknown.lora_id is None
    assert unknown.to_finish.status_code == 400 and "ff" * 16 in unknown.to_finish.message
    assert list(unknown.origin_input_ids) == [0]
    loaded = make_req("loaded", lora_id=VICTIM_ID)
    ingress.add_request_to_queue(lambda self, req: queued.append(req), scheduler, loaded)
    assert loaded.lora_id == VICTIM_ID and loaded.to_finish is None


def test_a_waiting_requests_key_is_what_its_admission_will_match():
    """`waiting_key` (the prefix the swapper evicts last for a queued request) of real `Req`s: the next turn of the
    same adapter, by content, matches the cached prompt; a retracted request's output counts; another adapter or
    tenant matches nothing, so a queued request never protects (or learns of) another namespace's KV; an unloaded
    adapter gives no key."""
    cache = tree_cache()
    owner = make_req("owner", lora_id=VICTIM_ID)
    cache.tree.insert(cache._key_for_req(owner, PROMPT + [7, 8]), list(range(len(PROMPT) + 2)))
    same_content = make_req("next", lora_id="c3" * 16)  # another id, the same weights
    wanted = cache.tree.prefix_node_ids([cache.waiting_key(same_content)])
    assert wanted and cache.tree.match(cache.waiting_key(same_content)).prefix_len == len(PROMPT)
    retracted = make_req("retracted", lora_id=VICTIM_ID)
    retracted.output_ids = [7, 8]
    assert cache.tree.match(cache.waiting_key(retracted)).prefix_len == len(PROMPT) + 2
    for other in (make_req("other", lora_id=OTHER_ID), make_req("base"),
                  make_req("salted", lora_id=VICTIM_ID, cache_salt="tenant-2")):
        assert cache.tree.prefix_node_ids([cache.waiting_key(other)]) == set(), other.rid
    assert cache.waiting_key(make_req("unloaded", lora_id="ff" * 16, strict=False)) is None


def test_the_multiqueue_scheduler_prices_a_request_by_what_the_tree_does_not_hold():
    """`LiveScheduler.on_arrival` on real `Req`s and our radix cache: a follow-up whose prompt the tree holds but
    for its last token is priced by that one token (`SchedRequest.cached_len`); another tenant's identical prompt
    finds nothing of it (namespaces) and is priced whole."""
    from sgl_multilora.patches.live_scheduler import LiveScheduler

    cache = tree_cache()
    cache.tree.insert(cache._key_for_req(make_req("t1", lora_id=VICTIM_ID), PROMPT), list(range(len(PROMPT))))
    live = LiveScheduler(SimpleNamespace(tree_cache=cache, max_total_num_tokens=10_000))
    for req in (make_req("t2", lora_id=VICTIM_ID), make_req("other", lora_id=VICTIM_ID, cache_salt="tenant-2")):
        live.on_arrival(req)
    t2, other = (live.mq.queues.get(rid) for rid in ("t2", "other"))
    assert (t2.in_len, t2.cached_len, t2.new_len) == (len(PROMPT), len(PROMPT) - 1, 1)
    assert (other.cached_len, other.new_len) == (0, len(PROMPT))
    assert t2.cost_tokens < other.cost_tokens and t2.wrs < other.wrs

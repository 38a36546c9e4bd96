"""The ingress attack catalogue, as data: cross-namespace cache attacks, crash inputs and malformed
inputs, each a `/generate` body.

A victim request (an adapter, or a tenant's `cache_salt`) caches a long prompt; each cache attack
then sends the same prompt with crafted namespace fields, and any cached token it reads is KV
computed for the victim's namespace. Crash inputs are single requests that stopped stock SGLang 0.5.23's server
processes; malformed inputs are requests it mishandled (an internal error, a dead server, or extra
entries silently ignored). Only request bodies live here, so tests (`tests/e2e/test_ingress.py`,
`tests/integration/test_ingress_keys.py`) import it without a server or HTTP client. Not here:
sending them and the stock-vs-ours report (`eval/security/run.py`).
"""

from __future__ import annotations

import random
import string
import uuid
from dataclasses import dataclass, field

ENCODED_PREFIX = "mlora1:"  # the namespace encoding of strict ingress, the default (patches/ingress.py)


@dataclass(frozen=True)
class Attack:
    """One attack request: `fields` are added to a /generate body that repeats the victim's prompt."""

    name: str
    fields: dict = field(default_factory=dict)


def lora_paths_id(name: str, path: str) -> str:
    """The internal id SGLang 0.5.23 gives a `--lora-paths name=path` adapter (`LoRARef.deterministic_id`):
    computable by anyone who knows the name and path."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"{name}\0{path}").hex


def cache_attacks(victim_id: str, victim_identity: str | None, other_adapter: str, *, num_random: int = 12,
                  seed: int = 0) -> list[Attack]:
    """Attacks on an adapter victim whose internal id is `victim_id` (and content identity `victim_identity`)."""
    attacks = [
        Attack("extra_key = victim's lora id", {"extra_key": victim_id}),
        Attack("lora_id field = victim's lora id", {"lora_id": victim_id}),
        Attack("lora id split across extra_key / cache_salt", {"extra_key": victim_id[:16], "cache_salt": victim_id[16:]}),
        Attack("cache_salt = victim's lora id", {"cache_salt": victim_id}),
        Attack("extra_key + cache_salt = victim's lora id", {"extra_key": victim_id, "cache_salt": victim_id}),
        Attack("other adapter, extra_key = victim's lora id", {"lora_path": other_adapter, "extra_key": victim_id}),
        Attack("extra_key = strict encoding of the victim's id", {"extra_key": f'{ENCODED_PREFIX}[null,"{victim_id}"]'}),
    ]
    if victim_identity:
        attacks += [
            Attack("extra_key = victim's content identity", {"extra_key": victim_identity}),
            Attack("extra_key = strict encoding of the victim's identity",
                   {"extra_key": f'{ENCODED_PREFIX}[null,"{victim_identity}"]'}),
        ]
    rng = random.Random(seed)
    pieces = [victim_id, victim_id[: rng.randrange(1, 32)], victim_id[rng.randrange(1, 32):], "|", "\0", '"', "\\",
              ENCODED_PREFIX, "null", "[", "]", ",", "é", "🔑", "".join(rng.choices(string.printable, k=8))]
    for i in range(num_random):
        extra = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 4)))
        body = {"extra_key": extra}
        if rng.random() < 0.5:
            body["cache_salt"] = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 3)))
        if rng.random() < 0.3:
            body["lora_path"] = other_adapter
        attacks.append(Attack(f"random namespace #{i}", body))
    return attacks


def tenant_attacks(victim_salt: str) -> list[Attack]:
    """Attacks on a tenant whose base-model requests carry `cache_salt = victim_salt`."""
    return [
        Attack("extra_key = victim tenant's salt", {"extra_key": victim_salt}),
        Attack("salt split across extra_key / cache_salt",
               {"extra_key": victim_salt[:4], "cache_salt": victim_salt[4:]}),
        Attack("salt prefix as cache_salt", {"cache_salt": victim_salt[:-1]}),
    ]


def crash_inputs(vocab_size: int) -> list[Attack]:
    """Single requests that stopped every process of a stock SGLang 0.5.23 CPU server."""
    return [
        Attack("unknown lora_id", {"lora_id": uuid.uuid4().hex}),
        Attack("token id outside the vocabulary", {"input_ids": [1, 2, vocab_size + 7]}),
        Attack("negative token id", {"input_ids": [1, -3, 2]}),
        Attack("empty text prompt", {"text": ""}),
        Attack("top_logprobs_num above the vocabulary size",
               {"return_logprob": True, "top_logprobs_num": 10 * vocab_size}),
    ]


def malformed_inputs(adapter: str) -> list[Attack]:
    """`lora_path` lists that do not give one adapter per prompt. Stock SGLang 0.5.23 answers a shorter list with HTTP
    500, ignores the extra entries of a longer one, and a list sent with a single prompt stops its server; none gets
    a 400 naming the problem."""
    return [
        Attack("lora_path list shorter than the batch", {"text": ["a", "b"], "lora_path": [adapter]}),
        Attack("lora_path list longer than the batch", {"text": ["a", "b"], "lora_path": [adapter] * 3}),
        Attack("lora_path list for a single prompt", {"text": "a", "lora_path": [adapter]}),
    ]

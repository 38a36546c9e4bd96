"""Deterministic prompt text from token counts, for the live driver.

A request's fresh text is `new_tokens` words drawn from WORDS, seeded by a stable hash of its rid; a shared prefix's
text is seeded by its id, so every request naming it starts with the same text. Each word is one token in
BPE vocabularies of the GPT-2/Llama family (checked against the embedded model's tokenizer in the tests), so the
server's prompt length is close to the planned one; the server's own count is what the results record.
"""

from __future__ import annotations

import zlib

from eval.workloads.records import Request

_WORD_LIST = (
    "the of and to in is for that on with as it at by from this be are was or an have not all can but "
    "more one time new will some about use other most many work year make first world well place day "
    "home water city light music river stone garden market story bridge window paper letter school "
    "house road tree sun sea book game team food hand part word point line group name state family "
    "way life child long great small high old good last right big few next same open best free"
)
WORDS = tuple(_WORD_LIST.split())


def words(seed_key: str, num: int) -> str:
    """`num` words, each with a leading space, the same for the same seed_key."""
    state = zlib.crc32(seed_key.encode())
    out = []
    for _ in range(num):
        state = (
            state * 1103515245 + 12345
        ) & 0x7FFFFFFF  # an LCG: stable across Python versions and runs
        out.append(WORDS[(state >> 8) % len(WORDS)])
    return "".join(" " + w for w in out)


def fresh_text(req: Request, invocation_text: str = "", invocation_len: int = 0) -> str:
    """The text that follows the history in `req`'s prompt: the shared prefix for a session's first request,
    fresh words, and the aLoRA invocation when `req.alora_invocation` (taking `invocation_len` of new_tokens).
    A trace request with literal text returns that text (plus the invocation if it lacks it)."""
    if req.prompt_text is not None:
        text = req.prompt_text
        if req.alora_invocation and invocation_text and not text.endswith(invocation_text):
            text += invocation_text
        return text
    num = req.new_tokens
    prefix = ""
    if req.shared_prefix and req.parent_rid is None:
        prefix = words("prefix:" + req.shared_prefix, req.shared_prefix_tokens)
        num -= req.shared_prefix_tokens
    suffix = ""
    if req.alora_invocation:
        suffix = invocation_text
        num -= invocation_len
    return prefix + words("rid:" + req.rid, max(num, 1 if not suffix else 0)) + suffix

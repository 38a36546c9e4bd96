"""Admission against the LoRA server's cache (`--multilora-lora-server`): InfiniLoRA's rule (§2.2), per scheduler."""

from __future__ import annotations

import time

from sgl_multilora.patches.lora_remote import address, client


class RemoteAdmission:
    """InfiniLoRA's admission rule against the LoRA server's cache (§2.2), in one scheduler process: a request with an
    adapter goes in when its adapter is in use already (by a running request of any worker: each declares its own
    with `residency(active=...)`), or when fewer adapters than the server's slots are in use, i.e. a slot is free or
    holds an adapter nobody uses; otherwise it waits, and the queue goes on to the next request. An admitted adapter
    not yet resident is prefetched out of band, so it loads while the batch is being formed. The server's view is
    asked at most once per VIEW_TTL_S; adapters admitted since count as in use."""

    VIEW_TTL_S = 0.02

    def __init__(self, client_fn=None) -> None:
        self._client = client_fn or client  # -> a LoRAServerClient (this process's, by default)
        self._view: dict | None = None
        self._asked = 0.0
        self._claimed: set[str] = set()
        self._prefetched: set[str] = set()
        self.waits = 0  # requests kept waiting for a slot

    def _refresh(self, running_names: set[str]) -> dict | None:
        now = time.monotonic()
        if self._view is None or now - self._asked > self.VIEW_TTL_S:
            from sgl_multilora.lora_server.client import LoRAServerError, LoRAServerUnavailable

            try:
                self._view = self._client().residency(active=sorted(running_names))
            except (LoRAServerUnavailable, LoRAServerError):
                self._view = None  # unknown: admit, and let the forward's call fail with HTTP 503 if it is down
            self._asked, self._claimed, self._prefetched = now, set(), set()
        return self._view

    def admits(self, name: str, running_names: set[str]) -> bool:
        """Whether a request for adapter `name` may join the batch being formed, `running_names` being the adapters
        of this worker's running requests. Counts a refusal in `waits`."""
        view = self._refresh(running_names)
        if view is None:
            return True
        in_use = set(view["in_use"]) | running_names | self._claimed
        if name in in_use:
            return True
        # Every adapter of one forward must sit in a slot while its call computes, so adapters in use never
        # outnumber the slots: a resident adapter nobody uses counts as a free slot, not as a reason to admit.
        if len(in_use) < int(view["max_slots"]):
            self._claimed.add(name)
            if name not in view["resident"] and name not in self._prefetched:
                self._prefetched.add(name)
                try:
                    self._client().prefetch([name])
                except Exception:  # a hint only: the first delta call loads it anyway
                    pass
            return True
        self.waits += 1
        return False


_admission: RemoteAdmission | None = None


def admission() -> RemoteAdmission | None:
    """This scheduler's admission against the LoRA server (made on first use); None without
    `--multilora-lora-server`."""
    global _admission
    if address() is None:
        return None
    if _admission is None:
        _admission = RemoteAdmission()
    return _admission


def current() -> RemoteAdmission | None:
    """This scheduler's admission if one was made (for its counters), else None."""
    return _admission

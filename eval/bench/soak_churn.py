"""Soak benchmark adapter churn: copies of bundled adapters loaded under new names, held while
requests target them, unloaded, and still targeted a little longer (the last two names also
whenever no copy is loaded).
Not here: the requests themselves (soak_traffic.py) or judging the answers (soak_outcomes.py).

SGLang 0.5.23 remembers every name it ever loaded and loads an unloaded adapter again, from its
old path, when a request names it. Every other cycle deletes the copy right after the unload, so
such a request gets a 400 naming the adapter; in the other cycles it gets an answer. Both are
allowed outcomes.
"""

from __future__ import annotations

import random
import shutil
import threading
import time
from collections import deque
from pathlib import Path

from eval.bench.soak_traffic import Adapter, Client

CHURN_PREFIX = "churn-"


class Churn:
    """Owns the copies and their names. `targets()` may be called from any thread."""

    def __init__(self, client: Client, sources: list[Adapter], workdir: Path, seed: int,
                 hold_s: tuple[float, float] = (3.0, 8.0),
                 grace_s: tuple[float, float] = (1.0, 3.0)):
        self.client, self.sources, self.workdir = client, sources, workdir
        self.rng = random.Random(seed)
        self.hold_s, self.grace_s = hold_s, grace_s
        self.lock = threading.Lock()
        self._targets: dict[str, Adapter] = {}
        self._recent: deque[tuple[str, Adapter]] = deque(maxlen=2)
        self.num_cycles = 0

    def targets(self) -> list[tuple[str, Adapter]]:
        """The copies loaded or just unloaded; else the last ones unloaded, so a churn request
        always has a target even when answers take longer than a cycle."""
        with self.lock:
            return list(self._targets.items()) or list(self._recent)

    def _set_target(self, name: str, source: Adapter | None) -> None:
        with self.lock:
            if source is None:
                if name in self._targets:
                    self._recent.append((name, self._targets.pop(name)))
            else:
                self._targets[name] = source

    def _copy(self, name: str, source: Adapter) -> Path:
        path = self.workdir / name
        shutil.copytree(source.path, path)
        return path

    def cycle(self, stop: threading.Event) -> None:
        """One load, hold, unload, grace cycle; cut short (still unloading) once `stop` is set."""
        self.num_cycles += 1
        source = self.rng.choice(self.sources)
        # fixed width: no name is a prefix of another, so "names the adapter" is unambiguous
        name = f"{CHURN_PREFIX}{source.name}-{self.num_cycles:05d}"
        path = self._copy(name, source)
        rec = self.client.post_admin("load", name, "/load_lora_adapter",
                                     {"lora_name": name, "lora_path": str(path)})
        if rec.status == 200:
            self._set_target(name, source)
            stop.wait(self.rng.uniform(*self.hold_s))
        self.client.post_admin("unload", name, "/unload_lora_adapter", {"lora_name": name})
        if self.num_cycles % 2 == 0:
            shutil.rmtree(path, ignore_errors=True)
        stop.wait(self.rng.uniform(*self.grace_s))
        self._set_target(name, None)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.cycle(stop)

    def wait_for_target(self, timeout_s: float) -> bool:
        """Blocks until some copy is loaded (so a phase's first churn request has a target)."""
        deadline = time.monotonic() + timeout_s
        while not self.targets() and time.monotonic() < deadline:
            time.sleep(0.1)
        return bool(self.targets())

    def cleanup(self, loaded_names: list[str]) -> None:
        """Unloads the copies a request loaded again after their unload, then deletes every copy."""
        for name in loaded_names:
            if name.startswith(CHURN_PREFIX):
                self.client.post_admin("unload", name, "/unload_lora_adapter", {"lora_name": name})
        for path in self.workdir.glob(f"{CHURN_PREFIX}*"):
            shutil.rmtree(path, ignore_errors=True)
        with self.lock:
            self._targets.clear()
            self._recent.clear()

"""Soak benchmark traffic: the bundled adapters, prompts, the mix of request kinds, and the HTTP
client that records what each request saw. Only ever talks to the one loopback server.
Not here: adapter churn (soak_churn.py), judging answers (soak_outcomes.py), phases (soak.py).
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import requests

from eval.bench.soak_outcomes import AdminRecord, RequestRecord

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

WORDS = ["river", "city", "garden", "music", "winter", "stone", "light", "market", "story",
         "bridge", "forest", "window", "paper", "ocean", "mountain", "letter", "harbor", "school"]
QUESTIONS = ["What is the capital of France?", "Name three colors of the rainbow.",
             "What do bees make?", "Why is the sky blue?", "Give me a tip for sleeping well.",
             "What is a volcano?"]
NUM_SHARED_DOCS = 4  # documents that recur across requests and adapters: cached prefixes get reused
# kind -> weight in the mix
MIX = {"base": 3, "lora": 3, "alora": 2, "churn": 3, "disconnect": 1, "abort": 1, "bad_input": 1}
QUICK_KINDS = ("bad_input", "abort")  # answered at once, or aborted within a second


@dataclass(frozen=True)
class Adapter:
    """A bundled adapter: its folder name (the served name), path, an aLoRA's invocation ids."""

    name: str
    path: Path
    invocation_ids: tuple[int, ...] = ()

    @property
    def is_alora(self) -> bool:
        return bool(self.invocation_ids)


def find_adapters(adapters_dir: Path) -> list[Adapter]:
    """Every PEFT adapter folder under `adapters_dir`; an aLoRA's config has
    `alora_invocation_tokens`."""
    out = []
    for config_path in sorted(adapters_dir.glob("*/adapter_config.json")):
        config = json.loads(config_path.read_text())
        tokens = tuple(config.get("alora_invocation_tokens") or ())
        out.append(Adapter(config_path.parent.name, config_path.parent, tokens))
    if not out:
        raise FileNotFoundError(f"no adapter_config.json under {adapters_dir}")
    return out


@dataclass
class Job:
    """One request: the `/generate` body without `rid` and `stream`, and what the client does."""

    kind: str
    adapter: str | None
    body: dict
    stream: bool
    disconnect_after_chunks: int | None = None
    abort_after_s: float | None = None
    refusable: str | None = None
    must_refuse: str | None = None


class Prompts:
    """Token ids of chat prompts: short questions, shared documents (cache hits), fresh documents
    (cache growth and eviction)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer

    def _document(self, seed: int, rng: random.Random) -> str:
        local = random.Random(seed)
        words = [local.choice(WORDS) for _ in range(local.randint(60, 300))]
        return f"Text {seed}: " + " ".join(words) + f"\n{rng.choice(QUESTIONS)}"

    def question(self, rng: random.Random) -> str:
        roll = rng.random()
        if roll < 0.4:
            return rng.choice(QUESTIONS)
        seed = rng.randrange(NUM_SHARED_DOCS) if roll < 0.7 else rng.randrange(10**9)
        return self._document(seed, rng)

    def chat(self, question: str, answer: str | None = None) -> list[int]:
        messages = [{"role": "user", "content": question}]
        if answer is None:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        messages.append({"role": "assistant", "content": answer})
        text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def alora(self, rng: random.Random, adapter: Adapter) -> list[int]:
        """A base conversation, then the adapter's invocation tokens (it activates from there)."""
        answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40)))
        return self.chat(self.question(rng), answer) + list(adapter.invocation_ids)


def _body(input_ids: list[int], adapter: str | None, max_new_tokens: int) -> dict:
    return {"input_ids": input_ids, "lora_path": adapter,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}


class Planner:
    """Draws the next job from MIX; thread-safe. `churn_targets` lists the (name, source) pairs of
    the adapters under load/unload churn right now (soak_churn.py)."""

    def __init__(self, prompts: Prompts, adapters: list[Adapter],
                 churn_targets: Callable[[], list[tuple[str, Adapter]]], seed: int):
        self.prompts, self.churn_targets = prompts, churn_targets
        self.loras = [a for a in adapters if not a.is_alora]
        self.aloras = [a for a in adapters if a.is_alora]
        self.rng, self.lock = random.Random(seed), threading.Lock()
        self.num_bad = 0
        self.first_kinds: list[str] = []

    def start_phase(self) -> None:
        """The phase's first jobs are one of each kind (even a short phase on a slow machine covers
        them all): the quick ones first, so every kind starts at once; later ones come from MIX."""
        with self.lock:
            slow = [k for k in MIX if k not in QUICK_KINDS]
            self.first_kinds = [*QUICK_KINDS, *self.rng.sample(slow, len(slow))]

    def next(self) -> Job:
        with self.lock:
            if self.first_kinds:
                kind = self.first_kinds.pop(0)
            else:
                kind = self.rng.choices(list(MIX), weights=list(MIX.values()))[0]
            return getattr(self, f"_{kind}")(self.rng)

    def _adapter(self, rng: random.Random) -> Adapter | None:
        return rng.choice([None, *self.loras, *self.aloras])

    def _prompt(self, rng: random.Random, adapter: Adapter | None) -> list[int]:
        if adapter is not None and adapter.is_alora:
            return self.prompts.alora(rng, adapter)
        return self.prompts.chat(self.prompts.question(rng))

    def _base(self, rng: random.Random) -> Job:
        body = _body(self._prompt(rng, None), None, rng.randint(4, 24))
        return Job("base", None, body, rng.random() < 0.5)

    def _lora(self, rng: random.Random) -> Job:
        a = rng.choice(self.loras)
        return Job("lora", a.name, _body(self._prompt(rng, a), a.name, rng.randint(4, 24)),
                   rng.random() < 0.5)

    def _alora(self, rng: random.Random) -> Job:
        a = rng.choice(self.aloras)
        return Job("alora", a.name, _body(self._prompt(rng, a), a.name, rng.randint(1, 4)),
                   rng.random() < 0.5)

    def _churn(self, rng: random.Random) -> Job:
        targets = self.churn_targets()
        if not targets:
            return self._lora(rng)
        name, source = rng.choice(targets)
        body = _body(self._prompt(rng, source), name, rng.randint(2, 16))
        return Job("churn", name, body, rng.random() < 0.5, refusable=name)

    def _disconnect(self, rng: random.Random) -> Job:
        a = self._adapter(rng)
        name = a.name if a else None
        body = _body(self._prompt(rng, a), name, 48)
        body["sampling_params"]["ignore_eos"] = True
        return Job("disconnect", name, body, True, disconnect_after_chunks=rng.randint(1, 4))

    def _abort(self, rng: random.Random) -> Job:
        a = self._adapter(rng)
        name = a.name if a else None
        body = _body(self._prompt(rng, a), name, 64)
        body["sampling_params"]["ignore_eos"] = True
        return Job("abort", name, body, rng.random() < 0.5, abort_after_s=rng.uniform(0.1, 1.0))

    def _bad_input(self, rng: random.Random) -> Job:
        self.num_bad += 1
        ids = self.prompts.chat(rng.choice(QUESTIONS))
        case = self.num_bad % 4
        if case == 0:
            name = f"no-such-adapter-{self.num_bad:06d}"
            return Job("bad_input", name, _body(ids, name, 4), False, must_refuse=name)
        if case == 1:  # an aLoRA prompt without its invocation sequence
            a = rng.choice(self.aloras)
            return Job("bad_input", a.name, _body(ids, a.name, 4), False, must_refuse=a.name)
        if case == 2:
            return Job("bad_input", None, _body(ids, None, -1), False, must_refuse="max_new_tokens")
        return Job("bad_input", None, _body([], None, 4), rng.random() < 0.5, must_refuse="empty")


@dataclass
class Client:
    """Sends jobs to one server and records what came back; `admin` collects its abort calls."""

    url: str
    t0: float
    timeout_s: float
    admin: list[AdminRecord] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def post_admin(self, action: str, name: str, path: str, body: dict) -> AdminRecord:
        rec = AdminRecord(action, name, self.now())
        try:
            response = requests.post(self.url + path, json=body, timeout=(10, self.timeout_s))
            rec.status, rec.message = response.status_code, response.text[:1000]
        except requests.RequestException as e:
            rec.exception = f"{type(e).__name__}: {e}"
        rec.end_s = self.now()
        self.admin.append(rec)
        return rec

    def _abort(self, rec: RequestRecord) -> None:
        rec.abort_sent = True  # before the call: its answer may come after the aborted request's
        self.post_admin("abort", rec.rid, "/abort_request", {"rid": rec.rid})

    def send(self, job: Job) -> RequestRecord:
        rid = uuid.uuid4().hex  # fixed length: SGLang aborts every rid starting with the given one
        rec = RequestRecord(job.kind, job.adapter, job.stream, rid, self.now(),
                            refusable=job.refusable, must_refuse=job.must_refuse)
        timer = None
        if job.abort_after_s is not None:
            timer = threading.Timer(job.abort_after_s, self._abort, (rec,))
            timer.start()
        try:
            body = {**job.body, "rid": rid, "stream": job.stream}
            with requests.post(self.url + "/generate", json=body, stream=job.stream,
                               timeout=(10, self.timeout_s)) as response:
                rec.status = response.status_code
                if response.status_code != 200:
                    rec.message = response.text[:1000]
                elif job.stream:
                    self._read_stream(response, rec, job.disconnect_after_chunks)
                else:
                    self._finish(rec, response.json())
        except (requests.RequestException, ValueError, TypeError, AttributeError) as e:
            rec.exception = f"{type(e).__name__}: {e}"  # no answer, or a malformed one
        finally:
            if timer is not None:
                timer.cancel()
                timer.join()
            rec.end_s = self.now()
        return rec

    @staticmethod
    def _finish(rec: RequestRecord, out: dict) -> None:
        meta = out.get("meta_info", {})
        rec.completion_tokens = meta.get("completion_tokens", rec.completion_tokens)
        reason = meta.get("finish_reason")
        if reason:
            rec.finish_type, rec.finish_message = reason.get("type"), reason.get("message") or ""

    def _read_stream(self, response: requests.Response, rec: RequestRecord,
                     disconnect_after: int | None) -> None:
        for line in response.iter_lines():
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return
            chunk = json.loads(payload)
            if "error" in chunk:
                error = chunk["error"]
                rec.stream_error_code = int(error.get("code") or 500)
                rec.message = str(error.get("message", ""))[:1000]
                continue
            rec.num_chunks += 1
            self._finish(rec, chunk)
            if disconnect_after and rec.num_chunks >= disconnect_after and not rec.finish_type:
                rec.disconnected = True  # leaving the `with` block closes the connection mid-stream
                return
        if rec.finish_type is None and rec.stream_error_code is None:
            rec.exception = "stream ended without [DONE]"

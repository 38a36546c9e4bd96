"""The independent oracle: Hugging Face PEFT (fp32, same converted checkpoint) computes each adapter's greedy output,
and `assert_matches` holds a server response to it token by token, logprob by logprob.

Greedy decoding is done by hand (argmax of the last position per step, a KV cache, no generation config). Each step
records the chosen token's logprob (log_softmax of the logits), the top ORACLE_TOP_K logprobs and the gap between the
top two. An aLoRA gets its activation start from the prompt (the last invocation sequence, as `PeftModel.generate`
computes it once per call) and passes it to every forward as `alora_offsets`, so decoding can use a KV cache and a
test can shift the start on purpose. Every comparison is counted in `STATS`; `tests/conftest.py` prints the counts
and fails the run when more than MAX_EARLY_SHARE of the comparisons ended early at a near tie.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

# Largest allowed |served logprob - PEFT logprob| for a generated token and for each top-k entry. Both sides are
# fp32 on CPU but compute differently (SGLang's torch_native attention, paged KV, chunked prefill, batching and our
# LoRA layers vs HF sdpa attention and PEFT's LoRA layers), so they agree to rounding, not bit for bit. Measured over
# the e2e modules (2026-11-24; 112 comparisons, 1757 tokens, top-5 at every token): max abs diff 4.6e-5 on the
# generated tokens and 6.1e-5 on the top-5 entries, so 1e-3 leaves a margin of 16x. A wrong aLoRA activation start
# (one position early or late, bundled aLoRAs, five prompts) moves the label's logprob by 2.0e-3 to 3.3e-1 and some
# top-5 entry of the label step by 0.48 to 4.1, and changes a later token in 15 of the 20 cases.
LOGPROB_ATOL = 1e-3
# Two tokens whose PEFT logits are closer than this may swap places on the server: each side's logprobs are within
# LOGPROB_ATOL of the truth, so their gap can move by twice that.
NEAR_TIE = 2 * LOGPROB_ATOL
TOP_K = 5  # top logprobs compared per generated token (SGLang's `top_logprobs_num`)
ORACLE_TOP_K = 2 * TOP_K  # kept by the oracle, so a served top-k entry at the boundary can still be looked up
MIN_COMPARED_TOKENS = 8  # generated tokens every comparison covers (unless it ends early at a near tie)
MAX_EARLY_SHARE = 0.05  # a run fails when more of its comparisons than this end early at a near tie
PAD_SLACK = 1.25  # the oracle batches prompts whose lengths differ by at most this factor (`PeftOracle.prefetch`)
# Adapters kept loaded in the oracle's PEFT model; the least recently used one is deleted past this. PEFT's
# `load_adapter` walks every module of the model, its other adapters' included: with 24 random adapters loaded a
# load took about 1 s, with a few 0.2 s. A deleted adapter loads again from its directory when a prompt needs it.
MAX_LOADED_ADAPTERS = 4


@dataclass(frozen=True)
class OracleOutput:
    """PEFT's greedy continuation: per generated token its id, logprob, top-ORACLE_TOP_K and top-2 logit gap."""

    tokens: list[int]
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    top2_gaps: list[float]
    stopped_at_eos: bool

    def head(self, num_tokens: int) -> OracleOutput:
        n = num_tokens
        return OracleOutput(self.tokens[:n], self.logprobs[:n], self.top_ids[:n], self.top_logprobs[:n],
                            self.top2_gaps[:n], self.stopped_at_eos and n >= len(self.tokens))


@dataclass(frozen=True)
class Served:
    """What the server generated: token ids, each one's logprob, and (if asked for) its top-k as (id, logprob)."""

    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]] | None = None


def served_from(response: dict) -> Served:
    """Reads a `/generate` response sent with `return_logprob: true` (and `top_logprobs_num` for the top-k).

    The ids come from `output_token_logprobs`, which lists every generated token with its logprob."""
    meta = response["meta_info"]
    pairs = meta.get("output_token_logprobs")
    assert pairs is not None, "the request did not set return_logprob: the oracle compares logprobs too"
    top = meta.get("output_top_logprobs")
    return Served(
        tokens=[int(p[1]) for p in pairs],
        logprobs=[float(p[0]) for p in pairs],
        top=None if not top else [[(int(e[1]), float(e[0])) for e in step] for step in top],
    )


def logprob_fields(top_k: int = TOP_K) -> dict:
    """The `/generate` body fields that make the server return what `served_from` reads."""
    return {"return_logprob": True, "top_logprobs_num": top_k}


@dataclass
class OracleStats:
    """Counts over one pytest run (printed by tests/conftest.py)."""

    num_comparisons: int = 0
    num_tokens: int = 0
    early: list[str] = field(default_factory=list)
    max_logprob_diff: float = 0.0  # over the compared tokens' logprobs
    max_top_diff: float = 0.0  # over the compared top-k entries
    peft_seconds: float = 0.0  # spent computing PEFT's outputs (adapter loads included)

    def summary(self) -> str:
        return (f"oracle: {self.num_comparisons} comparisons, {self.num_tokens} tokens compared, "
                f"{len(self.early)} ended early at a near tie; max |logprob diff| {self.max_logprob_diff:.1e} "
                f"(tokens), {self.max_top_diff:.1e} (top-{TOP_K}), tolerance {LOGPROB_ATOL:.0e}; PEFT computed for "
                f"{self.peft_seconds:.0f} s")

    def merge(self, other: dict) -> None:
        """Adds another process's counts (`dataclasses.asdict` of its stats: a pytest-xdist worker's)."""
        self.num_comparisons += other["num_comparisons"]
        self.num_tokens += other["num_tokens"]
        self.early += other["early"]
        self.max_logprob_diff = max(self.max_logprob_diff, other["max_logprob_diff"])
        self.max_top_diff = max(self.max_top_diff, other["max_top_diff"])
        self.peft_seconds += other["peft_seconds"]

    def too_many_early(self) -> bool:
        return len(self.early) > MAX_EARLY_SHARE * self.num_comparisons

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Comparisons inside the block start from zero counts and are not added to the run's (tests of the
        comparison itself read what the block counted)."""
        saved = dataclasses.replace(self, early=list(self.early))
        fresh = OracleStats()
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(fresh, f.name))
        try:
            yield
        finally:
            for f in dataclasses.fields(self):
                setattr(self, f.name, getattr(saved, f.name))


STATS = OracleStats()


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Runs the block on one torch thread. The oracle's forwards are small (one token at a time on a 135M model)
    and share the CPU with the server under test: with two threads on a busy 2-core machine a decode step took 3 s,
    with one 0.24 s."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


class PeftOracle:
    """One fp32 base model; an adapter directory is loaded into a PEFT model sharing it when a prompt needs it (at
    most MAX_LOADED_ADAPTERS at a time). Results are cached per (adapter, prompt, activation shift, ignore_eos): a
    request for fewer tokens reuses a longer run. The time spent computing them adds to `STATS.peft_seconds`."""

    def __init__(self, model_path: str, eos_token_ids: set[int]):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        self.base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.eos_token_ids = eos_token_ids
        self.peft = None
        self.loaded: dict[str, str] = {}  # adapter dir -> PEFT adapter name, least recently used first
        self.num_loads = 0
        self._cache: dict[tuple, OracleOutput] = {}

    def _select(self, adapter_dir: str | None):
        from peft import PeftModel

        if adapter_dir is None:
            return None
        name = self.loaded.pop(adapter_dir, None)
        if name is None:
            name = f"a{self.num_loads}"
            self.num_loads += 1
            if self.peft is None:
                self.peft = PeftModel.from_pretrained(self.base, adapter_dir, adapter_name=name).eval()
            else:
                self.peft.load_adapter(adapter_dir, adapter_name=name)
        self.loaded[adapter_dir] = name  # now the most recently used
        self.peft.set_adapter(name)
        while len(self.loaded) > MAX_LOADED_ADAPTERS:
            self.peft.delete_adapter(self.loaded.pop(next(iter(self.loaded))))
        return self.peft

    def activation_start(self, adapter_dir: str, input_ids: list[int]) -> int | None:
        """Position of the last invocation sequence in `input_ids` (PEFT's own search); None for a standard LoRA
        or when the sequence is absent (PEFT then serves the base model)."""
        from peft.tuners.lora.variants import calculate_alora_offsets

        model = self._select(adapter_dir)
        name = self.loaded[adapter_dir]
        if not model.peft_config[name].alora_invocation_tokens:
            return None
        (offset,) = calculate_alora_offsets(model.peft_config, name, torch.tensor([input_ids]))
        return None if offset is None else len(input_ids) - offset

    @torch.no_grad()
    def greedy(self, adapter_dir: str | None, input_ids: list[int], max_new_tokens: int, *,
               ignore_eos: bool = False, activation_shift: int = 0) -> OracleOutput:
        """PEFT's greedy continuation of `input_ids` (stopping after an EOS unless `ignore_eos`).

        `activation_shift` moves an aLoRA's activation start by that many positions (a deliberately wrong oracle
        for the tests of the comparison itself)."""
        key = (adapter_dir, tuple(input_ids), activation_shift, ignore_eos)
        cached = self._cache.get(key)
        if cached is not None and (len(cached.tokens) >= max_new_tokens or cached.stopped_at_eos):
            return cached.head(max_new_tokens)
        with _timed(), one_thread():
            model = self._select(adapter_dir)
            start = self._shifted_start(adapter_dir, input_ids, activation_shift)
            with self._serving(model) as module:
                out = self._decode(module, input_ids, max_new_tokens, ignore_eos, start)
        self._cache[key] = out
        return out

    def _shifted_start(self, adapter_dir: str | None, input_ids: list[int], shift: int) -> int | None:
        """The aLoRA activation start moved by `shift` (None for the base model or a standard LoRA)."""
        start = None if adapter_dir is None else self.activation_start(adapter_dir, input_ids)
        if start is not None:
            start += shift
            assert 0 <= start < len(input_ids), f"activation start {start} outside the prompt"
        return start

    @contextlib.contextmanager
    def _serving(self, model) -> Iterator[torch.nn.Module]:
        """The module to run for `model` (None: the base model, which is the PEFT model with its adapters disabled
        once one is loaded)."""
        if model is None and self.peft is not None:
            with self.peft.disable_adapter():
                yield self.peft
        else:
            yield model if model is not None else self.base

    @torch.no_grad()
    def prefetch(self, items, *, ignore_eos: bool = False, batch_size: int = 8) -> None:
        """Computes many greedy continuations at once, so that the `greedy` calls for them read the cache.

        `items` are (adapter_dir, input_ids, max_new_tokens) or (adapter_dir, input_ids, max_new_tokens,
        activation_shift), each as `greedy` takes them. Prompts of one adapter and similar lengths decode together
        in left-padded batches of up to `batch_size` (explicit positions and attention mask, so each row computes
        what it computes alone, to rounding): a decode step of eight prompts costs about twice one prompt's on this
        model. Unlike `greedy`, it runs on all of torch's threads: call it while the server under test is idle (its
        requests answered), not next to a busy one. `tests/integration/test_oracle_batched.py` holds the batched
        results to the one-at-a-time ones."""
        wanted: dict[str | None, dict[tuple, tuple[list[int], int, int]]] = {}
        for item in items:
            adapter_dir, input_ids, max_new_tokens, shift = (*item, 0)[:4]
            key = (adapter_dir, tuple(input_ids), shift, ignore_eos)
            cached = self._cache.get(key)
            if cached is not None and (len(cached.tokens) >= max_new_tokens or cached.stopped_at_eos):
                continue
            rows = wanted.setdefault(adapter_dir, {})
            longest = max(max_new_tokens, rows[key][1] if key in rows else 0)
            rows[key] = (list(input_ids), longest, shift)
        with _timed():
            self._prefetch(wanted, ignore_eos, batch_size)

    def _prefetch(self, wanted: dict, ignore_eos: bool, batch_size: int) -> None:
        for adapter_dir, rows in wanted.items():
            model = self._select(adapter_dir)
            is_alora = model is not None and bool(model.peft_config[self.loaded[adapter_dir]].alora_invocation_tokens)
            for chunk in _length_buckets(sorted(rows, key=lambda k: len(rows[k][0])), batch_size):
                prompts = [rows[k][0] for k in chunk]
                starts = [self._shifted_start(adapter_dir, rows[k][0], rows[k][2]) for k in chunk] if is_alora \
                    else None
                with self._serving(model) as module:
                    outs = self._decode_batch(module, prompts, max(rows[k][1] for k in chunk), ignore_eos, starts)
                for k, out in zip(chunk, outs):
                    self._cache[k] = out

    def _decode_batch(self, model, prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool,
                      starts: list[int | None] | None) -> list[OracleOutput]:
        """`_decode` for several prompts of one adapter: left-padded, each row stopping at its own EOS."""
        width = max(len(p) for p in prompts)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        step_input = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        rows = [([], [], [], [], []) for _ in prompts]
        stopped = [False] * len(prompts)
        past = None
        for _ in range(max_new_tokens):
            extra = {}
            if starts is not None:
                extra = {"alora_offsets": [None if s is None else (len(p) - s if past is None else 1)
                                           for s, p in zip(starts, prompts)]}
            out = model(input_ids=step_input, attention_mask=mask, position_ids=positions, past_key_values=past,
                        use_cache=True, logits_to_keep=1, **extra)
            lp = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
            top = torch.topk(lp, ORACLE_TOP_K)
            for b, (tokens, logprobs, top_ids, top_lps, gaps) in enumerate(rows):
                if stopped[b]:
                    continue
                token = int(top.indices[b, 0])
                tokens.append(token)
                logprobs.append(float(top.values[b, 0]))
                top_ids.append([int(i) for i in top.indices[b]])
                top_lps.append([float(v) for v in top.values[b]])
                gaps.append(float(top.values[b, 0] - top.values[b, 1]))
                stopped[b] = token in self.eos_token_ids and not ignore_eos
            if all(stopped):
                break
            past, step_input = out.past_key_values, top.indices[:, :1]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions[:, -1:] + 1
        return [OracleOutput(*row, stopped_at_eos=stop) for row, stop in zip(rows, stopped)]

    def _decode(self, model, input_ids: list[int], max_new_tokens: int, ignore_eos: bool,
                start: int | None) -> OracleOutput:
        tokens, logprobs, top_ids, top_lps, gaps = [], [], [], [], []
        past, step_input = None, list(input_ids)
        for _ in range(max_new_tokens):
            extra = {} if start is None else {"alora_offsets": [len(input_ids) - start if past is None else 1]}
            out = model(input_ids=torch.tensor([step_input]), past_key_values=past, use_cache=True, logits_to_keep=1,
                        **extra)
            lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            top = torch.topk(lp, ORACLE_TOP_K)
            token = int(top.indices[0])
            tokens.append(token)
            logprobs.append(float(top.values[0]))
            top_ids.append([int(i) for i in top.indices])
            top_lps.append([float(v) for v in top.values])
            gaps.append(float(top.values[0] - top.values[1]))
            if token in self.eos_token_ids and not ignore_eos:
                return OracleOutput(tokens, logprobs, top_ids, top_lps, gaps, stopped_at_eos=True)
            past, step_input = out.past_key_values, [token]
        return OracleOutput(tokens, logprobs, top_ids, top_lps, gaps, stopped_at_eos=False)


@contextlib.contextmanager
def _timed() -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        STATS.peft_seconds += time.perf_counter() - start


def _length_buckets(keys: list[tuple], batch_size: int) -> Iterator[list[tuple]]:
    """Consecutive runs of `keys` (sorted by prompt length, key[1] the prompt) of at most `batch_size`, a run
    ending where a prompt is over PAD_SLACK times as long as its first: a short prompt padded to a long one's length
    costs a long prompt's prefill, more than batching saves where prefill dominates."""
    run: list[tuple] = []
    for key in keys:
        if run and (len(run) == batch_size or len(key[1]) > PAD_SLACK * len(run[0][1])):
            yield run
            run = []
        run.append(key)
    if run:
        yield run


def _check_top(served: list[tuple[int, float]], oracle: OracleOutput, i: int, what: str) -> None:
    """The served top-k holds the same tokens as PEFT's (up to near ties at its lower edge), each within
    LOGPROB_ATOL of PEFT's logprob for that token."""
    expected = dict(zip(oracle.top_ids[i], oracle.top_logprobs[i]))
    assert len(served) == min(TOP_K, len(expected)), f"{what}: token {i}: served top-k has {len(served)} entries"
    for token, lp in served:
        assert token in expected, f"{what}: token {i}: served top-k holds {token}, not in PEFT's top {ORACLE_TOP_K}"
        STATS.max_top_diff = max(STATS.max_top_diff, abs(lp - expected[token]))
        assert abs(lp - expected[token]) <= LOGPROB_ATOL, (
            f"{what}: token {i}: top-k logprob of {token} served {lp:.6f} vs PEFT {expected[token]:.6f}")
    lowest = min(lp for _, lp in served)
    served_ids = {token for token, _ in served}
    for token, lp in zip(oracle.top_ids[i][:TOP_K], oracle.top_logprobs[i][:TOP_K]):
        assert token in served_ids or lp < lowest + NEAR_TIE, (
            f"{what}: token {i}: PEFT's top-{TOP_K} token {token} ({lp:.6f}) missing from the served top-k "
            f"{served}")


def _check_logprob(served_lp: float, expected_lp: float, i: int, what: str) -> None:
    STATS.max_logprob_diff = max(STATS.max_logprob_diff, abs(served_lp - expected_lp))
    assert math.isfinite(served_lp) and abs(served_lp - expected_lp) <= LOGPROB_ATOL, (
        f"{what}: token {i}: logprob served {served_lp:.6f} vs PEFT {expected_lp:.6f} "
        f"(diff {abs(served_lp - expected_lp):.2e} > {LOGPROB_ATOL})")


def assert_matches(served: Served | dict, oracle: OracleOutput, what: str, *,
                   min_tokens: int = MIN_COMPARED_TOKENS) -> int | None:
    """Asserts the served tokens are PEFT's greedy tokens with the same logprobs (and top-k, when served);
    returns the position where the comparison ended early at a near tie, or None when it covered every token.

    At a step where PEFT's top two are within NEAR_TIE, the server may pick either: if it picked PEFT's token the
    comparison goes on, otherwise the served token's logprob is checked against PEFT's for that token and the
    comparison ends there (the continuations differ from then on), counted in STATS. The reference must hold at
    least `min_tokens` tokens: prompts and max_new_tokens (or ignore_eos) are chosen so that it does.
    """
    if isinstance(served, dict):
        served = served_from(served)
    assert len(served.logprobs) == len(served.tokens), f"{what}: logprobs missing from the response"
    assert len(oracle.tokens) >= min_tokens, (
        f"{what}: PEFT generated only {len(oracle.tokens)} tokens ({oracle.tokens}); raise max_new_tokens or set "
        f"ignore_eos so that the comparison covers at least {min_tokens}")
    for i, expected in enumerate(oracle.tokens):
        assert i < len(served.tokens), f"{what}: served stops after {served.tokens} but PEFT goes on: {oracle.tokens}"
        token = served.tokens[i]
        if token != expected:
            tied = dict(zip(oracle.top_ids[i], oracle.top_logprobs[i]))
            assert oracle.top2_gaps[i] < NEAR_TIE and token in tied, (
                f"{what}: token {i} differs: served {served.tokens[: i + 1]} vs PEFT {oracle.tokens[: i + 1]} "
                f"(PEFT's top-2 gap {oracle.top2_gaps[i]:.2e})")
            _check_logprob(served.logprobs[i], tied[token], i, what)
            assert tied[expected] - tied[token] < NEAR_TIE, f"{what}: token {i}: served a token far below PEFT's"
            STATS.num_comparisons += 1
            STATS.num_tokens += i + 1
            STATS.early.append(f"{what}: at token {i} (top-2 gap {oracle.top2_gaps[i]:.1e})")
            return i
        _check_logprob(served.logprobs[i], oracle.logprobs[i], i, what)
        if served.top is not None:
            _check_top(served.top[i], oracle, i, what)
    assert len(served.tokens) == len(oracle.tokens), (
        f"{what}: served {served.tokens} but PEFT stops: {oracle.tokens}")
    STATS.num_comparisons += 1
    STATS.num_tokens += len(oracle.tokens)
    return None


def assert_shift_rejected(served: Served | dict, oracle: PeftOracle, adapter_dir: str, input_ids: list[int],
                          max_new_tokens: int, what: str) -> None:
    """The comparison rejects `served` against PEFT with the aLoRA's activation start one position early and one
    late (uncounted in STATS): so a server whose start was off by one would fail the comparison that accepts it."""
    for shift in (-1, 1):
        wrong = oracle.greedy(adapter_dir, input_ids, max_new_tokens, ignore_eos=True, activation_shift=shift)
        with STATS.paused():
            try:
                assert_matches(served, wrong, what)
            except AssertionError as error:  # rejected for what it served, not for a malformed case
                if re.search(r"differs|logprob|top-k", str(error)):
                    continue
                raise
        raise AssertionError(f"{what}: the comparison accepts an activation start shifted by {shift}")

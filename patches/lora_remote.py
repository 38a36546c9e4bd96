"""LoRA computed by a LoRA server (`--multilora-lora-server ADDR`): the worker holds no adapter weights.

InfiniLoRA's split, on SGLang's `--model-impl transformers` path: the worker keeps its base weights and KV, and per
layer sends the activations of every LoRA-targeted projection group to the LoRA server (`sgl_multilora.lora_server`),
which holds the adapters and returns the deltas; the worker adds them to its own base output. One call per fused
projection group and layer (`GROUPS`), as the paper's one call per MoE sub-layer:

    q_proj ─┐                          o_proj ── "o"      gate_proj ─┐                 down_proj ── "down"
    k_proj ─┼─ "qkv" (outputs q|k|v)                      up_proj  ──┴─ "gate_up" (gate|up)
    v_proj ─┘

The first projection of a group the model calls submits the group's call for its input (only the rows of tokens an
adapter applies to: base tokens and aLoRA tokens before their activation start are never sent) and computes its own
base GEMM while the round trip is in flight; every projection of the group then takes its columns of the one reply.
HF's decoder layers call q/k/v (and gate/up) on one input tensor; a projection whose input is not the tensor its group
was submitted with gets a call of its own (`group` = its module), so the values never depend on that assumption.

Names: a name SGLang has not registered is resolved against the LoRA server's catalog in the HTTP process
(`on_demand.py`) and loaded with the path `lora-server://NAME`; the scheduler's load (`lora_transformers.py`) takes the
adapter's spec (identity, rank, targets, aLoRA tokens) from the catalog, validates it against this model and keeps no
weights. Every delta call names the adapter's identity as well as its name, so a server that has since reloaded a
name with other weights refuses the call instead of computing with them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from http import HTTPStatus

from sgl_multilora.adapters import (
    EXPERT_MODULES,
    AdapterError,
    AdapterSpec,
    LoadedAdapter,
    ModelShape,
    check_against_model,
)
from sgl_multilora.patches import flags

REMOTE_SCHEME = "lora-server://"

# module -> (group, the group's modules in output order)
GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "q_proj": ("qkv", ("q_proj", "k_proj", "v_proj")),
    "k_proj": ("qkv", ("q_proj", "k_proj", "v_proj")),
    "v_proj": ("qkv", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("o", ("o_proj",)),
    "gate_proj": ("gate_up", ("gate_proj", "up_proj")),
    "up_proj": ("gate_up", ("gate_proj", "up_proj")),
    "down_proj": ("down", ("down_proj",)),
}

_lock = threading.Lock()
_client = None
_entries: dict[str, dict] = {}  # name -> the catalog entry this process last read for it


def remote_path(name: str) -> str:
    return REMOTE_SCHEME + name


def is_remote(path: str | None) -> bool:
    return isinstance(path, str) and path.startswith(REMOTE_SCHEME)


def address() -> str | None:
    return flags.current().lora_server


def client():
    """This process's client of the LoRA server (made on first use); raises RuntimeError without the flag."""
    global _client
    addr = address()
    if addr is None:
        raise RuntimeError("sgl_multilora: no --multilora-lora-server is configured")
    with _lock:
        if _client is None:
            from sgl_multilora.lora_server.client import LoRAServerClient

            _client = LoRAServerClient(addr)
        return _client


def spec_from_catalog(name: str, info: dict) -> AdapterSpec:
    """The spec a worker serves `name` with, from the LoRA server's catalog entry `info` (`hello`'s)."""
    alora = info.get("invocation_tokens") if info.get("is_alora") else None
    modules = {m for per_layer in info["modules"].values() for m in per_layer}
    return AdapterSpec(
        name=name, path=remote_path(name), identity=str(info["identity"]), rank=int(info["rank"]),
        alpha=float(info["alpha"]), scaling=float(info["scaling"]), target_modules=tuple(sorted(modules)),
        alora_invocation_tokens=tuple(int(t) for t in alora) if alora else None)


def sglang_config(spec: AdapterSpec) -> dict:
    """The PEFT config SGLang's LoRA manager keeps for a remote adapter (its targets, rank and alpha; no weights)."""
    experts = [m for m in spec.target_modules if m in EXPERT_MODULES]  # PEFT's `target_parameters`, as on disk
    config = {"r": spec.rank, "lora_alpha": spec.alpha, "peft_type": "LORA",
              "target_modules": [m for m in spec.target_modules if m not in EXPERT_MODULES],
              "target_parameters": [f"mlp.{m}" for m in experts]}
    if spec.alora_invocation_tokens:
        config["alora_invocation_tokens"] = list(spec.alora_invocation_tokens)
    return config


class LoRAServerUnavailableError(ValueError):
    """The LoRA server did not answer in time: HTTP 503 naming it (SGLang answers a ValueError's `status_code`)."""

    status_code = HTTPStatus.SERVICE_UNAVAILABLE


def _unavailable(e: Exception) -> LoRAServerUnavailableError:
    return LoRAServerUnavailableError(f"the LoRA server at {address()} is unavailable ({e}); requests for LoRA "
                                      "adapters fail until it answers again")


def catalog_entry(name: str) -> dict:
    """The LoRA server's catalog entry of `name` (asked now). Raises AdapterError naming it when the server holds no
    such adapter, LoRAServerUnavailableError when the server does not answer."""
    from sgl_multilora.lora_server.client import LoRAServerUnavailable

    try:
        entry = client().catalog()["adapters"].get(name)
    except LoRAServerUnavailable as e:
        raise _unavailable(e) from None
    if entry is None:
        raise AdapterError(f"LoRA adapter '{name}' is not held by the LoRA server at {address()}")
    _entries[name] = entry
    return entry


def invocation_tokens(path: str) -> tuple[int, ...] | None:
    """The aLoRA invocation tokens of the remote adapter at `path` (`lora-server://NAME`) as this process last read
    its catalog entry; None for a standard LoRA or a name not read here."""
    entry = _entries.get(path[len(REMOTE_SCHEME):]) if is_remote(path) else None
    if entry is None or not entry.get("is_alora"):
        return None
    return tuple(int(t) for t in entry.get("invocation_tokens") or ()) or None


def load_remote(name: str, shape: ModelShape) -> tuple[LoadedAdapter, dict]:
    """The adapter a worker serves for `name` (its spec from the catalog, checked against `shape`; no weights) and
    the config SGLang's LoRA manager keeps for it. Raises AdapterError / LoRAServerUnavailableError."""
    spec = spec_from_catalog(name, catalog_entry(name))
    check_against_model(spec, shape)
    return LoadedAdapter(spec, {}), sglang_config(spec)


def manager_load(manager, lora_ref, shape: ModelShape, registry):
    """`LoRAManager.load_lora_adapter` for a `lora-server://NAME` ref: the spec staged and added to `registry`,
    SGLang's bookkeeping made from the config alone (no tensors). (No unified pool on such a worker: `cli.py`.)
    Returns SGLang's LoRAUpdateOutput."""
    try:
        loaded, config = load_remote(lora_ref.lora_name, shape)
    except (AdapterError, LoRAServerUnavailableError) as e:
        return manager.create_lora_update_result(success=False, error_message=str(e))
    registry.stage(lora_ref.lora_id, loaded)
    result = manager._load_lora_adapter_from_tensors(lora_ref, {}, config)
    if result.success:
        registry.add(lora_ref.lora_id, loaded.spec)
    else:
        registry.remove(lora_ref.lora_id)
    return result


@dataclass
class _Call:
    x: tuple  # the input the call was submitted for: (data_ptr, shape, version), see `_input_key`
    modules: tuple[str, ...]
    pending: object
    delta: torch.Tensor | None = None


def _input_key(x: torch.Tensor) -> tuple:
    """Which input tensor `x` is: each projection sees a fresh view (`reshape`) of its module's input, so views of
    one tensor share the storage address, shape and version counter (an in-place write in between bumps it)."""
    return x.data_ptr(), tuple(x.shape), x._version


class RemoteStep:
    """One forward's remote LoRA: which rows go, tagged with which adapters, and the calls in flight.

    `prepare` runs once per step (after the step's `SegmentMeta` is refilled); `submit` / `add_into` run per wrapped
    projection. Not thread-safe: one scheduler thread uses it."""

    def __init__(self, shape) -> None:
        self.shape = shape  # ModelShape: output widths of every module
        self.rows: torch.Tensor | None = None  # token rows an adapter applies to
        self.adapter_index: torch.Tensor | None = None  # per sent row: index into `names`
        self.names: list[str] = []
        self.identities: list[str] = []
        self.targeted: set[str] = set()  # modules some adapter of the step targets
        self.failed: str | None = None  # why a call of this step got no delta (its LoRA rows are wrong)
        self._calls: dict[tuple[int, str], _Call] = {}

    def prepare(self, meta, specs: list[AdapterSpec]) -> None:
        """`specs[s]` serves slot s of `meta` (meta.keys[s])."""
        self._calls.clear()
        self.failed = None
        n = meta.num_tokens
        slots = meta.token_slot[:n]
        rows = torch.nonzero(slots >= 0).flatten()
        self.rows = rows if rows.numel() else None
        self.adapter_index = slots[rows].to(torch.int32) if rows.numel() else None
        self.names = [s.name for s in specs]
        self.identities = [s.identity for s in specs]
        self.targeted = {m for s in specs for m in s.target_modules}

    @property
    def active(self) -> bool:
        return self.rows is not None

    def submit(self, layer_id: int, module: str, x2: torch.Tensor) -> _Call | None:
        """The call serving (`layer_id`, `module`) for input `x2` (rows, in), sent now unless its group's call for
        this very input is already in flight. Does not wait."""
        if self.rows is None or module not in self.targeted or self.failed is not None:
            return None
        group, modules = GROUPS[module]
        key, x_key = (layer_id, group), _input_key(x2)
        call = self._calls.get(key)
        if call is not None and call.x == x_key:
            return call
        if call is not None:  # another input than the group's call: the group again for it, under its own key
            key = (layer_id, module)
            own = self._calls.get(key)
            if own is not None and own.x == x_key:
                return own
        rows = x2.index_select(0, self.rows)  # a copy: the client sends it without one, so it must not change
        try:
            pending = client().submit_delta(layer_id, group, rows, self.adapter_index, self.names,
                                            identities=self.identities)
        except ConnectionError as e:  # LoRAServerUnavailable
            self.failed = str(e)
            return None
        call = _Call(x_key, modules, pending)
        self._calls[key] = call
        return call

    def add_into(self, call: _Call, module: str, out2: torch.Tensor) -> None:
        """Waits for `call` and adds `module`'s columns of its delta into `out2` (rows, out) in place. A call the
        server does not answer (or answers with an error) adds nothing and marks the step `failed`: its requests with
        adapters are then ended (`after_run_batch`), never answered with what the base model computed."""
        from sgl_multilora.lora_server.client import LoRAServerError, LoRAServerUnavailable

        if self.failed is not None:
            return
        if call.delta is None:
            try:
                call.delta = call.pending.result()
            except (LoRAServerUnavailable, LoRAServerError) as e:
                self.failed = str(e)
                return
        start = 0
        for m in call.modules:
            width = self.shape.modules[m].out_features
            if m == module:
                out2.index_add_(0, self.rows, call.delta[:, start:start + width].to(out2.dtype))
                return
            start += width
        raise RuntimeError(f"module {module} is not in the LoRA server call's group {call.modules}")


class RemoteAdmission:
    """InfiniLoRA's admission rule against the LoRA server's cache (§2.2), in one scheduler process: a request with an
    adapter goes in when the LoRA server holds its adapter, or when fewer adapters than the server's slots are in use
    by running requests (over every worker: each declares its own with `residency(active=...)`); otherwise it waits,
    and the queue goes on to the next request. An admitted adapter not yet resident is prefetched out of band, so it
    loads while the batch is being formed. The server's view is asked at most once per VIEW_TTL_S; adapters
    admitted since count as in use."""

    VIEW_TTL_S = 0.02

    def __init__(self) -> None:
        self._view: dict | None = None
        self._asked = 0.0
        self._claimed: set[str] = set()
        self._prefetched: set[str] = set()
        self.waits = 0  # requests kept waiting for a slot

    def _refresh(self, running_names: set[str]) -> dict | None:
        import time

        now = time.monotonic()
        if self._view is None or now - self._asked > self.VIEW_TTL_S:
            from sgl_multilora.lora_server.client import LoRAServerError, LoRAServerUnavailable

            try:
                self._view = client().residency(active=sorted(running_names))
            except (LoRAServerUnavailable, LoRAServerError):
                self._view = None  # unknown: admit, and let the forward's call fail with HTTP 503 if it is down
            self._asked, self._claimed, self._prefetched = now, set(), set()
        return self._view

    def admits(self, name: str, running_names: set[str]) -> bool:
        view = self._refresh(running_names)
        if view is None:
            return True
        resident, in_use = set(view["resident"]), set(view["in_use"]) | running_names | self._claimed
        if name in in_use or name in resident:
            self._claimed.add(name)
            return True
        if len(in_use) < int(view["max_slots"]):
            self._claimed.add(name)
            if name not in self._prefetched:
                self._prefetched.add(name)
                try:
                    client().prefetch([name])
                except Exception:  # a hint only: the first delta call loads it anyway
                    pass
            return True
        self.waits += 1
        return False


_admission: RemoteAdmission | None = None


def admission() -> RemoteAdmission | None:
    """This scheduler's admission against the LoRA server; None without `--multilora-lora-server`."""
    global _admission
    if address() is None:
        return None
    if _admission is None:
        _admission = RemoteAdmission()
    return _admission


class RemoteExpertDeltas:
    """The experts' LoRA deltas computed by the LoRA server (an `lora_experts.ExpertDeltaSource`): one call per MoE
    sub-layer and step (`experts.gate_up`, `experts.down`), InfiniLoRA's two round trips per MoE layer, carrying only
    the routed rows an adapter applies to, each tagged with its adapter and expert. Failures mark the step as
    `RemoteStep.add_into` does."""

    CALLS = {"gate_up": ("experts.gate_up", "experts.gate_up_proj"), "down": ("experts.down", "experts.down_proj")}

    def __init__(self, remote: RemoteStep) -> None:
        self.remote = remote

    def submit(self, layer_id, call, expert_ids, slot_ids, x):
        rs = self.remote
        group, module = self.CALLS[call]
        if rs.rows is None or module not in rs.targeted or rs.failed is not None:
            return None
        active = torch.nonzero(slot_ids >= 0).flatten()
        if not active.numel():
            return None
        try:
            pending = client().submit_delta(layer_id, group, x.index_select(0, active),
                                            slot_ids.index_select(0, active).to(torch.int32), rs.names,
                                            expert_ids=expert_ids.index_select(0, active).to(torch.int32),
                                            identities=rs.identities)
        except ConnectionError as e:  # LoRAServerUnavailable
            rs.failed = str(e)
            return None
        return active, pending, x.shape[0], x.dtype

    def result(self, handle):
        from sgl_multilora.lora_server.client import LoRAServerError, LoRAServerUnavailable

        if handle is None or self.remote.failed is not None:
            return None
        active, pending, num_rows, dtype = handle
        try:
            delta = pending.result()
        except (LoRAServerUnavailable, LoRAServerError) as e:
            self.remote.failed = str(e)
            return None
        out = torch.zeros(num_rows, delta.shape[1], dtype=dtype)
        out.index_copy_(0, active, delta.to(dtype))
        return out


def expert_source(step):
    """The experts' delta source where a LoRA server computes them (`step.remote` set), else None."""
    return None if step.remote is None else RemoteExpertDeltas(step.remote)


def after_run_batch(result, self, batch, *args, **kwargs):
    """AFTER `Scheduler.run_batch(batch)`: where a LoRA server call of this forward failed, every request of the batch
    with an adapter ends with HTTP 503 naming the server, and its KV (computed without its deltas) is never cached;
    the base model's requests of the batch continue."""
    from sgl_multilora.patches.state import process_state

    lora = process_state().lora
    remote = None if lora is None else lora.step.remote
    if remote is None or remote.failed is None or batch is None:
        return
    message = (f"the LoRA server at {address()} failed during this request's forward ({remote.failed}); requests for "
               "LoRA adapters fail until it answers again")
    for req in batch.reqs:
        if getattr(req, "lora_id", None) is not None and not req.finished():
            req.skip_radix_cache_insert = True
            req.set_finish_with_abort(message, status_code=HTTPStatus.SERVICE_UNAVAILABLE)
    remote.failed = None

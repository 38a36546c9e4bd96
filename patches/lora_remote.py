"""LoRA computed by a LoRA server (`--multilora-lora-server ADDR`): the worker holds no adapter weights.

InfiniLoRA's split, on SGLang's `--model-impl transformers` path: the worker keeps its base weights and KV and sends
each layer's LoRA-targeted activations to the LoRA server (`sgl_multilora.lora_server`), which holds the adapters and
returns the deltas (`remote_deltas.py`); admission asks the server's cache (`remote_admission.py`).

Lives here: this process's client, names and loading, faults and counters. A name SGLang has not registered is
resolved against the LoRA server's catalog in the HTTP process (`on_demand.py`) and loaded with the path
`lora-server://NAME`; the scheduler's load (`lora_transformers.py`) takes the adapter's spec (identity, rank,
targets, aLoRA tokens) from the catalog, validates it against this model and keeps no weights. Every delta call names
the adapter's identity as well as its name, so a server that has since reloaded a name with other weights refuses
the call instead of computing with them. A forward whose call fails ends its adapter requests with HTTP 503
(`after_run_batch`).
"""

from __future__ import annotations

import threading
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
        entry = client().catalog([name])["adapters"].get(name)
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
    remote.counters["failed_steps"] += 1


def stats() -> dict | None:
    """This scheduler's side of the LoRA server (`/multilora/stats` "lora_server"): its address, the calls and rows
    sent, the seconds the forward waited for replies after its base GEMMs (the round trip not hidden), failed steps
    and admission waits; None without `--multilora-lora-server`."""
    from sgl_multilora.patches.state import process_state

    if address() is None:
        return None
    lora = process_state().lora
    counters = dict(lora.step.remote.counters) if lora is not None and lora.step.remote is not None else {}
    counters["wait_s"] = round(counters.get("wait_s", 0.0), 6)
    from sgl_multilora.patches import remote_admission

    adm = remote_admission.current()
    return {"address": address(), **counters, "admission_waits": adm.waits if adm is not None else 0}

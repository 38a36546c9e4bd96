"""The `--multilora-*` server flags: one description per field of `MultiLoRAArgs`, from which the parser, its
help and docs/flags.md are all made; and how the values reach every SGLang process.

SGLang's argument parser rejects unknown flags and its `ServerArgs` record is sealed, so the flags are added to
SGLang's own parser (they appear in `python -m sglang.launch_server --help` under "sgl_multilora"), taken out of the
parsed namespace before `ServerArgs` is built, and exported as one JSON environment variable that every spawned
process (scheduler, detokenizer, data-parallel controller) inherits. `current()` reads it in any process.

Behaviours of ours that exist in stock SGLang too are not flags of their own: `--multilora-stock-baseline PART[,PART]`
turns each named part back to stock SGLang's behaviour, for comparisons (a field with a `part`). docs/flags.md is
`python -m sgl_multilora.patches.flags --markdown`; tests/unit/test_flags.py checks it is current.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from dataclasses import asdict, dataclass, field, fields

ENV_VAR = "MULTILORA_SERVER_ARGS"  # not SGL_*: SGLang rewrites SGL_* variables to SGLANG_*
PREFIX = "multilora_"
STOCK_BASELINE = "--multilora-stock-baseline"
SWAP_INTERVAL_MS = 100.0
"""How often the idle swapper may prefetch adapters and host KV (milliseconds): a tuning constant no measurement
has given a reason to change, so not a flag."""


def _adapter_dir(value: str) -> str:
    if not os.path.isdir(value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a directory")
    subdirs = [d for d in sorted(os.listdir(value)) if os.path.isfile(os.path.join(value, d, "adapter_config.json"))]
    if not subdirs:
        raise argparse.ArgumentTypeError(f"{value!r} holds no adapter (no */adapter_config.json)")
    return os.path.abspath(value)


def _directory(value: str) -> str:
    if not os.path.isdir(value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a directory")
    return os.path.realpath(value)


def _adapter_source(value: str) -> tuple[str, str]:
    from sgl_multilora.adapter_sources import parse_source

    try:
        return parse_source(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _zmq_address(value: str) -> str:
    if not (value.startswith("ipc://") and len(value) > 6) and not (
            value.startswith("tcp://") and value.rpartition(":")[2].isdigit()):
        raise argparse.ArgumentTypeError(f"{value!r} is not a ZMQ address (ipc://PATH or tcp://HOST:PORT)")
    return value


def _number(cast, ok, what: str):
    """A parser of one number: `cast` it, then `ok(number)` or an argparse error saying it is not `what`."""
    def parse(value: str):
        try:
            number = cast(value)
        except ValueError:
            number = None
        if number is None or not ok(number):
            raise argparse.ArgumentTypeError(f"{value!r} is not {what}")
        return number

    parse.__name__ = what  # argparse names the type in some errors
    return parse


_positive_int = _number(int, lambda n: n > 0, "a positive integer")
_non_negative_int = _number(int, lambda n: n >= 0, "a non-negative integer")
_fraction = _number(float, lambda x: 0.0 <= x <= 1.0, "a number between 0 and 1")
_non_negative_float = _number(float, lambda x: x >= 0, "a number >= 0")
_positive_float = _number(float, lambda x: x > 0, "a positive number")


def _flag(name: str, default, help: str, *, choices: tuple[str, ...] | None = None, parse=None,
          metavar: str | None = None, repeatable: bool = False):
    """A field set by the flag `name`: its help, and how a value is parsed (`choices`, `parse`; a bool default makes
    a switch; `repeatable`: each use adds one value to a tuple)."""
    return field(default=default, metadata={"flag": name, "help": help, "choices": choices, "parse": parse,
                                            "metavar": metavar, "repeatable": repeatable})


def _part(part: str, default, stock, help: str):
    """A field that `--multilora-stock-baseline part` sets to `stock`, stock SGLang's behaviour; `help` says what
    ours does instead."""
    return field(default=default, metadata={"part": part, "stock": stock, "help": help})


@dataclass(frozen=True)
class MultiLoRAArgs:
    """Values of the `--multilora-*` flags (defaults are what a server without the flags gets)."""

    adapter_dir: str | None = _flag(
        "--multilora-adapter-dir", None, "Load every PEFT adapter in a sub-directory of DIR at start-up, named after "
        "its sub-directory (added to --lora-paths; implies --enable-lora).", parse=_adapter_dir, metavar="DIR")
    adapter_root: str | None = _flag(
        "--multilora-adapter-root", None, "Load adapters only from inside DIR (symlinks resolved): a "
        "/load_lora_adapter request for a path outside it gets HTTP 400 that reveals nothing about the path; a "
        "relative path is taken under DIR.", parse=_directory, metavar="DIR")
    adapter_source: tuple = _flag(
        "--multilora-adapter-source", (), "Resolve an adapter a request names but no process has loaded from this "
        "source, by name, on its first request (repeatable; asked in order): a directory of adapter directories "
        "(DIR/<name>/), 'hf-cache:DIR' (a Hugging Face hub cache, offline; names '<org>/<name>') or "
        "'<scheme>:<arg>' of a resolver registered under the entry-point group sgl_multilora.adapter_resolvers. "
        "Nothing is read at start-up; a name no source holds gets HTTP 400.", parse=_adapter_source,
        metavar="[SCHEME:]DIR", repeatable=True)
    host_adapter_gb: float = _flag(
        "--multilora-host-adapter-gb", 0.0, "Budget of the adapters' host copies, in GB (1e9 bytes of weight files; "
        "0: no limit): after each load, the least recently used adapters not in use and not pinned are unloaded "
        "until the rest fit; one from a source is read again on its next request.", parse=_non_negative_float,
        metavar="GB")
    lora_server: str | None = _flag(
        "--multilora-lora-server", None, "Compute every LoRA delta on the LoRA server at ADDR (python -m "
        "sgl_multilora.lora_server): this server holds no adapter weights, serves every adapter the LoRA server "
        "holds by name (ranks and targets learnt from it) and sends each layer's LoRA-targeted activations there, "
        "overlapping the round trip with its base GEMM.", parse=_zmq_address, metavar="ADDR")
    max_adapter_mb: int = _flag(
        "--multilora-max-adapter-mb", 4096, "Largest adapter weight file (adapter_model.safetensors or .bin) the "
        "server loads, in MiB; a larger one gets HTTP 400 naming both sizes.", parse=_positive_int, metavar="MB")
    lora_ops: str = _flag(
        "--multilora-lora-ops", "auto", "LoRA op implementation of --lora-backend multilora and of the CPU path: "
        "'auto' (Triton on CUDA, 'cpu' elsewhere), 'triton', 'cpu' (the host op: one gather, two matmuls per "
        "adapter, one scatter), 'torch' (the plain references) or 'flashinfer' (FlashInfer's segment GEMM; GPU "
        "only, never exercised by a benchmark).", choices=("auto", "triton", "cpu", "torch", "flashinfer"))
    eviction_policy: str = _flag(
        "--multilora-eviction-policy", "elora", "Score the unified pool evicts KV and adapters by, lowest first: "
        "'elora' (ELORA's cost model), 'chameleon' or 'lru'.", choices=("elora", "chameleon", "lru"))
    idle_watermark: float = _flag(
        "--multilora-idle-watermark", 0.7, "Prefetch adapters and host KV into the unified pool only while it is "
        "used below this fraction (0: never prefetch).", parse=_fraction, metavar="FRACTION")
    host_kv_gb: float = _flag(
        "--multilora-host-kv-gb", 0.0, "Host tier for the KV the unified pool evicts, in GB (1e9 bytes, as "
        "SGLang's --hicache-size; 0: off): evicted KV is written there and copied back when a request reaches it "
        "again, instead of being recomputed.", parse=_non_negative_float, metavar="GB")
    scheduler: str = _flag(
        "--multilora-scheduler", "stock", "Who decides which waiting requests an admission pass takes: 'stock' "
        "(SGLang's --schedule-policy alone) or 'multiqueue' (Chameleon's adapter-aware queues by weighted request "
        "size with per-queue token quotas, then SGLang's pass over the requests they pick).",
        choices=("stock", "multiqueue"))
    ttft_slo_s: float = _flag(
        "--multilora-ttft-slo-s", 5.0, "multiqueue: the time-to-first-token SLO the quotas (Tok_min >= S D "
        "(1/SLO + lambda)) and the squash and hold rules are sized for, in seconds.", parse=_positive_float,
        metavar="S")
    slot_squash_share: float = _flag(
        "--multilora-slot-squash-share", 0.5, "multiqueue with --max-loras-per-batch: a request that has waited "
        "this share of the TTFT SLO for an adapter slot gets one: the running requests of the adapter cheapest to "
        "recompute are retracted (before that, only a predicted SLO miss does it). Lower: shorter first-token "
        "waits, longer end-to-end times for the retracted requests.", parse=_fraction, metavar="FRACTION")
    memory_hold_share: float = _flag(
        "--multilora-memory-hold-share", 0.5, "multiqueue with the unified pool: once a request's adapter has not "
        "fitted (even after evicting every idle adapter) for this share of the TTFT SLO, no other request is "
        "admitted until it is, so that what the running requests free goes to its adapter (0: never, the "
        "published algorithm).", parse=_non_negative_float, metavar="SHARE")
    check_invariants: bool = _flag(
        "--multilora-check-invariants", False, "Test mode: check the LoRA-aware tree's, the pool's and the "
        "scheduler's invariants after every scheduler step (slow; a violation stops the server); pair it with "
        "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY=1 for the KV slot accounting.")
    # Parts of --multilora-stock-baseline: ours by default, stock SGLang's when named.
    lora_compute: str = _part(
        "lora-compute", "auto", "sglang", "Our LoRA layers compute where SGLang's do not reach the model (the "
        "--model-impl transformers path, where SGLang's fused qkv/gate_up targets match no module); SGLang's "
        "elsewhere. Stock: SGLang's own everywhere.")
    extend_attention: str = _part(
        "extend-attention", "ours", "stock", "CPU extend attention (--attention-backend torch_native) for the "
        "new tokens' rows only, against the cached prefix plus themselves (cost grows with new x total tokens). "
        "Stock: every cached position's row recomputed and dropped (total squared).")
    decode_attention: str = _part(
        "decode-attention", "ours", "stock", "CPU decode attention (--attention-backend torch_native) in one call "
        "per group of requests of similar KV length. Stock: one call per request and layer.")
    ingress: str = _part(
        "ingress", "strict", "stock", "Strict ingress: clients cannot set lora_id, every adapter's and tenant's "
        "cached KV is kept apart, inputs that crash SGLang's scheduler get HTTP 400. Stock: SGLang's own handling "
        "(a request can then read another adapter's cached KV or stop the server).")
    memory: str = _part(
        "memory", "unified", "separate", "With --radix-cache-backend multilora, adapter weights live in KV slots "
        "of one pool, evicted and prefetched with the KV by one score. Stock: adapters in their own tensors.")
    disable_kv_moves: bool = _part(
        "kv-moves", False, True, "Unified pool: when an adapter's matrices do not fit the free slots scattered "
        "between running requests' KV, the KV of the window holding the least is moved (between steps) rather "
        "than evicted or waited out. Stock: eviction alone frees room.")
    cpu_overlap: bool = _part(
        "cpu-overlap", False, True, "With the radix backend on --device cpu, SGLang's overlap scheduler is off "
        "(the forward runs in the scheduler's thread, so overlapping only delays each batch's results by one "
        "step). Stock: the overlap scheduler stays on.")
    radix_backend: bool = False
    """Set at parse time: the radix-cache backend is ours (the unified pool needs it)."""

    @property
    def max_adapter_bytes(self) -> int:
        return self.max_adapter_mb << 20

    @property
    def swap_interval_ms(self) -> float:
        return SWAP_INTERVAL_MS


def _flags() -> list:
    return [f for f in fields(MultiLoRAArgs) if "flag" in f.metadata]


def _parts() -> dict[str, object]:
    """Part name -> its field, in declaration order."""
    return {f.metadata["part"]: f for f in fields(MultiLoRAArgs) if "part" in f.metadata}


def _stock_parts(value: str) -> list[str]:
    names = [p.strip() for p in value.split(",") if p.strip()]
    unknown = [p for p in names if p not in _parts()]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown part(s) {unknown or [value]}; parts: {', '.join(_parts())}")
    return names


STOCK_BASELINE_HELP = ("Restore stock SGLang's behaviour for each PART, for comparisons (repeatable, or a comma "
                       "list): " + ", ".join(_parts()) + ". docs/flags.md says what each part turns off.")


def unified_memory_requested() -> bool:
    """The server runs one pool for adapters and KV: `--radix-cache-backend multilora`, `memory` not restored to
    stock."""
    args = current()
    return args.radix_backend and args.memory == "unified"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Adds the `--multilora-*` flags to SGLang's parser (a group of their own in --help), one per described field
    and `--multilora-stock-baseline`."""
    group = parser.add_argument_group("sgl_multilora", "Multi-LoRA serving (the sgl_multilora plugin).")
    for f in _flags():
        meta = f.metadata
        if isinstance(f.default, bool):
            group.add_argument(meta["flag"], dest=PREFIX + f.name, action="store_true", default=f.default,
                               help=meta["help"])
            continue
        if meta["repeatable"]:
            group.add_argument(meta["flag"], dest=PREFIX + f.name, default=[], type=meta["parse"], action="append",
                               metavar=meta["metavar"], help=meta["help"])
            continue
        group.add_argument(meta["flag"], dest=PREFIX + f.name, default=f.default, choices=meta["choices"],
                           type=meta["parse"], metavar=meta["metavar"], help=meta["help"])
    group.add_argument(STOCK_BASELINE, dest=PREFIX + "stock_baseline", type=_stock_parts, action="extend",
                       default=[], metavar="PART[,PART]", help=STOCK_BASELINE_HELP)


def pop_from_namespace(namespace: argparse.Namespace) -> MultiLoRAArgs:
    """Removes the `multilora_*` attributes from a parsed namespace and returns them as a record, each stock
    baseline part set to its stock value."""
    values = {}
    for f in _flags():
        attr = PREFIX + f.name
        if hasattr(namespace, attr):
            values[f.name] = getattr(namespace, attr)
            if f.metadata["repeatable"]:
                values[f.name] = tuple(values[f.name])
            delattr(namespace, attr)
    parts = _parts()
    for part in getattr(namespace, PREFIX + "stock_baseline", None) or ():
        values[parts[part].name] = parts[part].metadata["stock"]
    if hasattr(namespace, PREFIX + "stock_baseline"):
        delattr(namespace, PREFIX + "stock_baseline")
    return MultiLoRAArgs(**values)


def export(args: MultiLoRAArgs) -> None:
    """Makes `args` what `current()` returns here and in every process spawned from now on."""
    os.environ[ENV_VAR] = json.dumps(asdict(args))


def current() -> MultiLoRAArgs:
    """The flags this server was started with (defaults when started without them, e.g. through the Engine API)."""
    return _parse(os.environ.get(ENV_VAR, ""))


@functools.lru_cache(maxsize=4)
def _parse(raw: str) -> MultiLoRAArgs:
    if not raw:
        return MultiLoRAArgs()
    values = json.loads(raw)
    for f in _flags():
        if f.metadata["repeatable"] and f.name in values:  # JSON made the tuples lists
            values[f.name] = tuple(tuple(v) if isinstance(v, list) else v for v in values[f.name])
    return MultiLoRAArgs(**values)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _default(value) -> str:
    if value is None or value == ():
        return "none"
    if isinstance(value, bool):
        return "off" if not value else "on"
    return f"{value:g}" if isinstance(value, float) else str(value)


def markdown() -> str:
    """docs/flags.md: every flag and every stock baseline part, from the same descriptions as --help."""
    intro = ("Generated by `python -m sgl_multilora.patches.flags --markdown` from the one description of each flag "
             "in patches/flags.py (the `--help` text comes from the same place; tests/unit/test_flags.py checks that "
             "this page is current). Every flag is added to `python -m sglang.launch_server`.")
    lines = ["# Server flags", "", intro, "",
             "| flag | default | what it does |", "|---|---|---|"]
    for f in _flags():
        meta = f.metadata
        value = "{" + ",".join(meta["choices"]) + "}" if meta["choices"] else meta["metavar"]
        name = f"`{meta['flag']}{' ' + value if value else ''}`"
        lines.append(f"| {name} | `{_default(f.default)}` | {_cell(meta['help'])} |")
    lines.append(f"| `{STOCK_BASELINE} PART[,PART]` | `none` | {_cell(STOCK_BASELINE_HELP)} |")
    parts = (f"What each part of `{STOCK_BASELINE}` turns back to stock SGLang's behaviour. They exist for "
             "comparisons (eval/): a server for users names none of them.")
    lines += ["", "## Stock baseline parts", "", parts, "", "| part | ours, and what stock does instead |", "|---|---|"]
    lines += [f"| `{part}` | {_cell(f.metadata['help'])} |" for part, f in _parts().items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m sgl_multilora.patches.flags --markdown > docs/flags.md")
    sys.stdout.write(markdown())

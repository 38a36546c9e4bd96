"""The `--multilora-*` server flags: their definitions, validation, and how they reach every SGLang process.

SGLang's argument parser rejects unknown flags and its `ServerArgs` record is sealed, so the flags are added to
SGLang's own parser (they appear in `python -m sglang.launch_server --help` under "sgl_multilora"), taken out of the
parsed namespace before `ServerArgs` is built, and exported as one JSON environment variable that every spawned
process (scheduler, detokenizer, data-parallel controller) inherits. `current()` reads it in any process.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from dataclasses import asdict, dataclass, fields

ENV_VAR = "MULTILORA_SERVER_ARGS"  # not SGL_*: SGLang rewrites SGL_* variables to SGLANG_*
PREFIX = "multilora_"


@dataclass(frozen=True)
class MultiLoRAArgs:
    """Values of the `--multilora-*` flags (defaults are what a server without the flags gets)."""

    # Who computes LoRA layers. `auto`: ours where SGLang's LoRA layers do not reach the model (the
    # `--model-impl transformers` path, where SGLang's fused qkv/gate_up targets match no module), SGLang's elsewhere.
    # `sglang`: always SGLang's own (its stock behaviour).
    lora_compute: str = "auto"
    # A directory whose sub-directories are PEFT adapters; each is loaded at start-up under its directory name,
    # as if given to --lora-paths.
    adapter_dir: str | None = None
    # CPU extend attention (`--attention-backend torch_native`). `ours`: only the new tokens' rows, against the
    # cached prefix plus themselves (cost grows with new x total tokens). `stock`: SGLang's path, which recomputes
    # every cached position's row and drops it (cost grows with total squared).
    extend_attention: str = "ours"
    # CPU decode attention (`--attention-backend torch_native`). `ours`: one SDPA call per group of requests of
    # similar KV length, the layout built once per step. `stock`: SGLang's path, one call per request and layer.
    decode_attention: str = "ours"
    # Which implementation `--lora-backend multilora` runs its LoRA ops with: `auto` (Triton on CUDA, the torch
    # references elsewhere), `triton`, `torch`, or `flashinfer` (its segment GEMM; GPU only, needs flashinfer).
    lora_ops: str = "auto"
    # Request ingress (`ingress.py`). `strict`: clients cannot set lora_id, cache namespaces are unambiguous
    # (client extra_key, adapter content identity), inputs that crash SGLang's scheduler get HTTP 400. `stock`: SGLang
    # 0.5.23's own handling, for baseline measurements only (a request can then read another adapter's cached KV or
    # stop the server).
    ingress: str = "strict"
    # Adapters are loaded only from inside this directory (symlinks resolved): a load outside it gets HTTP 400
    # that reveals nothing about the path. A relative lora_path in /load_lora_adapter is taken under it.
    adapter_root: str | None = None
    # Largest adapter weight file accepted, in MiB (a larger one gets HTTP 400 naming both sizes).
    max_adapter_mb: int = 4096
    # Test mode: check the LoRA-aware tree's invariants after every scheduler step (an assertion stops the server);
    # pair it with SGLang's SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY=1 for the KV slot accounting.
    check_invariants: bool = False
    # Adapter weights and KV in one pool (`unified`: an adapter made resident takes KV slots and gives them back
    # when evicted) or SGLang's separate adapter tensors (`separate`, for comparison). Only with
    # `--radix-cache-backend multilora`.
    memory: str = "unified"
    # The score the swapper evicts by (lowest first): `elora` (ELORA's cost model), `chameleon`, `lru`.
    eviction_policy: str = "elora"
    # How often the idle swapper may prefetch adapters (milliseconds).
    swap_interval_ms: float = 100.0
    # Prefetch adapters only while the pool is used below this fraction.
    idle_watermark: float = 0.7
    # Who decides which waiting requests an admission pass takes: `stock` (SGLang's --schedule-policy alone) or
    # `multiqueue` (Chameleon's adapter-aware queues with token quotas, then SGLang's pass over those requests).
    scheduler: str = "stock"
    # multiqueue: refit the queues' cut-offs and quotas this often (seconds; 0: never after the first fit).
    requeue_s: float = 300.0
    # multiqueue: the TTFT SLO in the quota rule Tok_min >= S D (1/SLO + lambda) (seconds).
    ttft_slo_s: float = 5.0
    # multiqueue with --max-loras-per-batch: a request that has waited this share of the TTFT SLO for an adapter slot
    # gets one by a slot squash, whatever the prediction says.
    slot_squash_share: float = 0.5
    # multiqueue with --max-loras-per-batch: a request is retracted by slot squashes at most this often (0: never).
    max_slot_squashes: int = 1
    # multiqueue with the unified pool: a request whose adapter has not fitted for this share of the TTFT SLO holds
    # admission until it does (0: never).
    memory_hold_share: float = 0.5
    # Host tier for KV the pool evicts, in GB (1e9 bytes, as SGLang's --hicache-size): evicted KV is written there
    # and copied back instead of recomputed; 0 turns it off. Needs the unified pool.
    host_kv_gb: float = 0.0
    # Never move KV to free a run for an adapter (compaction); eviction alone frees runs then.
    disable_kv_moves: bool = False
    # Keep SGLang's overlap scheduler on --device cpu (turned off there otherwise: nothing overlaps the forward).
    cpu_overlap: bool = False
    # Set at parse time: the radix-cache backend is ours (the unified pool needs it).
    radix_backend: bool = False

    @property
    def max_adapter_bytes(self) -> int:
        return self.max_adapter_mb << 20


LORA_COMPUTE_CHOICES = ("auto", "sglang")
EXTEND_ATTENTION_CHOICES = ("ours", "stock")
DECODE_ATTENTION_CHOICES = ("ours", "stock")
LORA_OPS_CHOICES = ("auto", "triton", "cpu", "torch", "flashinfer")
INGRESS_CHOICES = ("strict", "stock")
MEMORY_CHOICES = ("unified", "separate")
EVICTION_POLICY_CHOICES = ("elora", "chameleon", "lru")
SCHEDULER_CHOICES = ("stock", "multiqueue")


def unified_memory_requested() -> bool:
    """The server runs one pool for adapters and KV: `--radix-cache-backend multilora` with `--multilora-memory
    unified` (the default)."""
    args = current()
    return args.radix_backend and args.memory == "unified"


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


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number <= 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive integer")
    return number


def _non_negative_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a non-negative integer")
    return number


def _fraction(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not 0.0 <= number <= 1.0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number between 0 and 1")
    return number


def _non_negative_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not number >= 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number >= 0")
    return number


def _positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = 0.0
    if not number > 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive number")
    return number


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Adds the `--multilora-*` flags to SGLang's parser (a group of their own in --help)."""
    group = parser.add_argument_group("sgl_multilora", "Multi-LoRA serving (the sgl_multilora plugin).")
    group.add_argument(
        "--multilora-lora-compute",
        choices=LORA_COMPUTE_CHOICES,
        default=MultiLoRAArgs.lora_compute,
        help="Who computes LoRA layers: 'auto' uses sgl_multilora's LoRA layers where SGLang's do not reach the "
        "model (--model-impl transformers) and SGLang's elsewhere; 'sglang' always uses SGLang's own.",
    )
    group.add_argument(
        "--multilora-adapter-dir",
        type=_adapter_dir,
        default=MultiLoRAArgs.adapter_dir,
        metavar="DIR",
        help="Load every PEFT adapter found in DIR/<name>/ at start-up, named after its sub-directory "
        "(added to --lora-paths; implies --enable-lora).",
    )
    group.add_argument(
        "--multilora-extend-attention",
        choices=EXTEND_ATTENTION_CHOICES,
        default=MultiLoRAArgs.extend_attention,
        help="'ours' computes CPU extend attention for the new tokens only (torch_native backend); "
        "'stock' keeps SGLang's path.",
    )
    group.add_argument(
        "--multilora-decode-attention",
        choices=DECODE_ATTENTION_CHOICES,
        default=MultiLoRAArgs.decode_attention,
        help="'ours' computes CPU decode attention in one call per group of requests of similar length "
        "(torch_native backend); 'stock' keeps SGLang's path (one call per request and layer).",
    )
    group.add_argument(
        "--multilora-ingress",
        choices=INGRESS_CHOICES,
        default=MultiLoRAArgs.ingress,
        help="'strict' (default) rejects client-set lora_id, keeps every adapter's and tenant's cached KV apart "
        "and refuses inputs that crash SGLang's scheduler; 'stock' keeps SGLang's own request handling (baseline "
        "measurements only: unsafe).",
    )
    group.add_argument(
        "--multilora-adapter-root",
        type=_directory,
        default=MultiLoRAArgs.adapter_root,
        metavar="DIR",
        help="Load adapters only from inside DIR (symlinks resolved); /load_lora_adapter requests for paths "
        "outside it get HTTP 400 without any detail about the path. Relative request paths are taken under DIR.",
    )
    group.add_argument(
        "--multilora-max-adapter-mb",
        type=_positive_int,
        default=MultiLoRAArgs.max_adapter_mb,
        metavar="MB",
        help="Largest adapter weight file (adapter_model.safetensors or .bin) the server loads, in MiB.",
    )
    group.add_argument(
        "--multilora-check-invariants",
        action="store_true",
        default=MultiLoRAArgs.check_invariants,
        help="Test mode: check the LoRA-aware tree's invariants after every scheduler step (slow; a violation "
        "stops the server with the failed invariant).",
    )
    group.add_argument(
        "--multilora-disable-kv-moves",
        action="store_true",
        default=MultiLoRAArgs.disable_kv_moves,
        help="Unified pool: never move KV between slots. By default, when an adapter's matrices do not fit the "
        "free slots scattered between running requests' KV, the KV of the window holding the least of it is copied "
        "elsewhere (between scheduler steps, after any forward still in flight) rather than evicted or waited "
        "out. For comparison.",
    )
    group.add_argument(
        "--multilora-cpu-overlap",
        action="store_true",
        default=MultiLoRAArgs.cpu_overlap,
        help="Keep SGLang's overlap scheduler on --device cpu. Off by default there (as --disable-overlap-schedule): "
        "the forward runs in the scheduler's own thread, so overlapping hides nothing and only delays each batch's "
        "results, a prefill's first token included, by one forward. For comparison.",
    )
    group.add_argument(
        "--multilora-memory",
        choices=MEMORY_CHOICES,
        default=MultiLoRAArgs.memory,
        help="'unified' (default with --radix-cache-backend multilora): adapter weights live in KV slots of one "
        "pool, evicted and prefetched with the KV by one score; 'separate': adapters in their own tensors.",
    )
    group.add_argument(
        "--multilora-eviction-policy",
        choices=EVICTION_POLICY_CHOICES,
        default=MultiLoRAArgs.eviction_policy,
        help="Score for evicting KV and adapters from the unified pool: 'elora' (cost model), 'chameleon', 'lru'.",
    )
    group.add_argument(
        "--multilora-swap-interval-ms",
        type=_positive_float,
        default=MultiLoRAArgs.swap_interval_ms,
        metavar="MS",
        help="How often the idle swapper may prefetch adapters into the unified pool.",
    )
    group.add_argument(
        "--multilora-idle-watermark",
        type=_fraction,
        default=MultiLoRAArgs.idle_watermark,
        metavar="FRACTION",
        help="Prefetch adapters only while the unified pool is used below this fraction.",
    )
    group.add_argument(
        "--multilora-host-kv-gb",
        type=_non_negative_float,
        default=MultiLoRAArgs.host_kv_gb,
        metavar="GB",
        help="Host tier for the KV the unified pool evicts (GB of host memory; 0: off): evicted KV is written "
        "there and copied back when a request reaches it again, instead of being recomputed.",
    )
    group.add_argument(
        "--multilora-scheduler",
        choices=SCHEDULER_CHOICES,
        default=MultiLoRAArgs.scheduler,
        help="'stock': SGLang's --schedule-policy decides admission; 'multiqueue': adapter-aware queues by "
        "weighted request size with per-queue token quotas (Chameleon) pick which requests each pass may take.",
    )
    group.add_argument(
        "--multilora-requeue-s",
        type=float,
        default=MultiLoRAArgs.requeue_s,
        metavar="S",
        help="multiqueue: refit the queues' cut-offs and quotas every S seconds (0: never after the first fit).",
    )
    group.add_argument(
        "--multilora-ttft-slo-s",
        type=_positive_float,
        default=MultiLoRAArgs.ttft_slo_s,
        metavar="S",
        help="multiqueue: the time-to-first-token SLO the per-queue token quotas are sized for.",
    )
    group.add_argument(
        "--multilora-slot-squash-share",
        type=_fraction,
        default=MultiLoRAArgs.slot_squash_share,
        metavar="FRACTION",
        help="multiqueue: a request that has waited this share of --multilora-ttft-slo-s for one of "
        "--max-loras-per-batch adapter slots gets one: the running requests of the adapter cheapest to recompute "
        "are retracted (before that, only a predicted SLO miss does it). Lower: shorter first-token waits, longer "
        "end-to-end times for the retracted requests.",
    )
    group.add_argument(
        "--multilora-max-slot-squashes",
        type=_non_negative_int,
        default=MultiLoRAArgs.max_slot_squashes,
        metavar="N",
        help="multiqueue: a running request is retracted by slot squashes at most N times (0: no slot squash). "
        "Higher keeps squashing possible under sustained load, when every running adapter already holds a "
        "request retracted once; each retraction costs that request a recompute of what it had.",
    )
    group.add_argument(
        "--multilora-memory-hold-share",
        type=_non_negative_float,
        default=MultiLoRAArgs.memory_hold_share,
        metavar="SHARE",
        help="multiqueue with the unified pool: once a request's adapter has not fitted in memory (even after "
        "evicting every idle adapter) for this share of --multilora-ttft-slo-s, no other request is admitted until "
        "it is, so that what the running requests free goes to its adapter rather than to other queues' requests. "
        "0: never (the published algorithm, under which a steady stream into another queue can keep it out).",
    )
    group.add_argument(
        "--multilora-lora-ops",
        choices=LORA_OPS_CHOICES,
        default=MultiLoRAArgs.lora_ops,
        help="LoRA op implementation of --lora-backend multilora and of the CPU path: 'auto' (Triton on CUDA, "
        "'cpu' elsewhere), 'triton', 'cpu' (the host op: one gather, two matmuls per adapter, one scatter), "
        "'torch' (the plain references), or 'flashinfer' (FlashInfer's segment GEMM; GPU only).",
    )


def pop_from_namespace(namespace: argparse.Namespace) -> MultiLoRAArgs:
    """Removes the `multilora_*` attributes from a parsed namespace and returns them as a record."""
    values = {}
    for f in fields(MultiLoRAArgs):
        if f.name == "radix_backend":
            continue
        attr = PREFIX + f.name
        if hasattr(namespace, attr):
            values[f.name] = getattr(namespace, attr)
            delattr(namespace, attr)
    return MultiLoRAArgs(**values)


def export(args: MultiLoRAArgs) -> None:
    """Makes `args` what `current()` returns here and in every process spawned from now on."""
    os.environ[ENV_VAR] = json.dumps(asdict(args))


def current() -> MultiLoRAArgs:
    """The flags this server was started with (defaults when started without them, e.g. through the Engine API)."""
    return _parse(os.environ.get(ENV_VAR, ""))


@functools.lru_cache(maxsize=4)
def _parse(raw: str) -> MultiLoRAArgs:
    return MultiLoRAArgs(**json.loads(raw)) if raw else MultiLoRAArgs()

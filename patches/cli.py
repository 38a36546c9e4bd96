"""Hooks on SGLang's argument parsing that carry the `--multilora-*` flags (definitions in `flags.py`)."""

from __future__ import annotations

import dataclasses
import logging
import os

from sgl_multilora.patches import flags

logger = logging.getLogger(__name__)

REMOTE_MAX_LORA_RANK = 256  # --max-lora-rank of a worker of a LoRA server when not given


def add_cli_args(original, parser):
    original(parser)
    flags.add_cli_args(parser)
    from sgl_multilora.patches import lora_backend

    lora_backend.add_cli_choice(parser)  # --lora-backend multilora


def from_cli_args(original, cls, args):
    ours = flags.pop_from_namespace(args)
    if ours.adapter_dir:
        found = sorted(d for d in os.listdir(ours.adapter_dir)
                       if os.path.isfile(os.path.join(ours.adapter_dir, d, "adapter_config.json")))
        given = list(getattr(args, "lora_paths", None) or [])
        args.lora_paths = given + [f"{name}={os.path.join(ours.adapter_dir, name)}" for name in found]
        args.enable_lora = True
    if ours.adapter_source:
        args.enable_lora = True
    if ours.lora_server:
        # The worker holds no adapter weights: rank and targets bound nothing here (the LoRA server checks each
        # adapter against the model), so SGLang's up-front LoRA limits default to the widest.
        args.enable_lora = True
        if getattr(args, "max_lora_rank", None) is None:
            args.max_lora_rank = REMOTE_MAX_LORA_RANK
        if not getattr(args, "lora_target_modules", None):
            args.lora_target_modules = ["all"]
    ours = dataclasses.replace(ours, radix_backend=getattr(args, "radix_cache_backend", None) == "multilora"
                               and not getattr(args, "disable_radix_cache", False))
    if ours.lora_server and ours.memory == "unified":
        # The unified pool shares memory between adapter weights and KV; a worker of a LoRA server holds no adapter
        # weights, so its KV keeps SGLang's own pool (the tree, its keys and aLoRA reuse work as ever).
        ours = dataclasses.replace(ours, memory="separate")
    if ours.host_kv_gb and not (ours.radix_backend and ours.memory == "unified"):
        raise ValueError("--multilora-host-kv-gb needs --radix-cache-backend multilora and the unified pool (not "
                         "--multilora-stock-baseline memory): the host tier holds what the unified pool evicts")
    if (ours.radix_backend and not ours.cpu_overlap and getattr(args, "device", None) == "cpu"
            and not getattr(args, "disable_overlap_schedule", True)):
        # The overlap loop defers each batch's results behind the next batch's forward; on a CPU that forward runs
        # synchronously in this thread, so nothing overlaps and every first token waits one more decode step.
        logger.warning("sgl_multilora: overlap scheduler disabled on --device cpu (nothing runs concurrently with "
                       "the forward there; overlapping only delays each batch's results by one step; "
                       "--multilora-stock-baseline cpu-overlap keeps it)")
        args.disable_overlap_schedule = True
    flags.export(ours)
    return original(cls, args)

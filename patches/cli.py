"""Hooks on SGLang's argument parsing that carry the `--multilora-*` flags (definitions in `flags.py`)."""

from __future__ import annotations

import dataclasses
import os

from sgl_multilora.patches import flags


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
    ours = dataclasses.replace(ours, radix_backend=getattr(args, "radix_cache_backend", None) == "multilora"
                               and not getattr(args, "disable_radix_cache", False))
    if ours.host_kv_gb and not (ours.radix_backend and ours.memory == "unified"):
        raise ValueError("--multilora-host-kv-gb needs --radix-cache-backend multilora with --multilora-memory "
                         "unified (the host tier holds what the unified pool evicts)")
    flags.export(ours)
    return original(cls, args)

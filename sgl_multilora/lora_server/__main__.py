"""CLI: `python -m sgl_multilora.lora_server --adapter-dir DIR --model-path DIR --listen ADDR [--max-slots N]
[--slot-gb G] [--eviction-policy lru|elora|chameleon] [--device cpu|cuda]`. Stops cleanly on SIGTERM / SIGINT."""

from __future__ import annotations

import argparse
import logging
import signal

from sgl_multilora.lora_server.catalog import Catalog, ServerModel
from sgl_multilora.lora_server.server import LoRAServer
from sgl_multilora.lora_server.slots import SlotPool
from sgl_multilora.policy import POLICIES, chameleon, elora, lru  # noqa: F401  (each registers its policy)


def build_server(args: argparse.Namespace) -> LoRAServer:
    """The server the arguments describe (not started). Raises AdapterError / ValueError on a bad adapter or flag."""
    model = ServerModel.from_config(args.model_path)
    catalog = Catalog.from_dir(args.adapter_dir, model)
    max_bytes = int(args.slot_gb * 2**30) if args.slot_gb else None
    max_slots = args.max_slots or max(1, len(catalog.adapters))
    pool = SlotPool(catalog, max_slots, args.eviction_policy, max_bytes, args.device)
    return LoRAServer(catalog, pool, args.listen, impl=args.lora_impl)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sgl_multilora.lora_server", description=__doc__)
    p.add_argument("--adapter-dir", help="a directory whose sub-directories are PEFT LoRA adapters (name = dir name)")
    p.add_argument("--model-path", required=True, help="the base model's directory (its config.json gives the shape)")
    p.add_argument("--listen", required=True, help="ipc://PATH or tcp://HOST:PORT")
    p.add_argument("--max-slots", type=int, default=None, help="adapters resident at once (default: all)")
    p.add_argument("--slot-gb", type=float, default=None, help="bytes of resident adapter weights at most (GiB)")
    p.add_argument("--eviction-policy", default="lru", choices=sorted(POLICIES))
    p.add_argument("--device", default="cpu", help="where the slots live and compute runs (cpu, cuda, cuda:1)")
    p.add_argument("--lora-impl", default="auto", help="LoRA op implementation (auto, triton, cpu, torch)")
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
    server = build_server(args)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stop())
    server.serve_forever()


if __name__ == "__main__":
    main()

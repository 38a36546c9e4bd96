"""Where adapters may be loaded from: `--multilora-adapter-root` checked on `/load_lora_adapter` (HTTP process).

A load whose path resolves (symlinks followed, `..` collapsed) outside the root gets HTTP 400 with a message that
says nothing about the path, before any process opens it; inside the root the request continues with the resolved
absolute path, so the schedulers open exactly what was checked. The scheduler side checks again
(`lora_transformers.load_lora_adapter`), which also covers adapters given at start-up, and enforces the size limit.
"""

from __future__ import annotations

from sgl_multilora.adapters import AdapterError, resolve_under_root
from sgl_multilora.patches import flags, lora_remote, on_demand


async def load_lora_adapter(original, self, obj, *args, **kwargs):
    """AROUND hook on `TokenizerManager.load_lora_adapter(obj)`. After a load, the host tier's budget
    (`--multilora-host-adapter-gb`, `on_demand.py`) drops what no longer fits, whoever asked for the load."""
    root = flags.current().adapter_root
    if root is not None and not (lora_remote.address() and lora_remote.is_remote(obj.lora_path)):
        from sglang.srt.managers.io_struct import LoadLoRAAdapterReqOutput

        try:
            obj.lora_path = str(resolve_under_root(obj.lora_path or "", root, obj.lora_name or "?"))
        except AdapterError as e:
            return LoadLoRAAdapterReqOutput(success=False, error_message=str(e))
    result = await original(self, obj, *args, **kwargs)
    od = on_demand.state(self) if result.success else None
    if od is not None:
        await od.fit_host_budget(self, keep={obj.lora_name})
    return result

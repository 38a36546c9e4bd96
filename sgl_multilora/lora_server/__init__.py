"""InfiniLoRA's disaggregated LoRA server: workers hold no adapter weights; per layer they send the activations of
LoRA-targeted projections here over ZMQ and add the deltas that come back.

Files: `protocol.py` (the wire format), `catalog.py` (model shape, host copies of adapters as units), `slots.py`
(device slots and eviction), `compute.py` (delta maths), `server.py` (sockets and threads), `client.py` (the
worker's side), `__main__.py` (the CLI). Engine-agnostic: nothing here imports sglang.
"""

from sgl_multilora.lora_server.client import LoRAServerClient, LoRAServerError, LoRAServerUnavailable, Pending

__all__ = ["LoRAServerClient", "LoRAServerError", "LoRAServerUnavailable", "Pending"]

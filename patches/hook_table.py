"""Every SGLang symbol the plugin hooks, in one table, with the parameters each hook relies on.

`check()` resolves each target and compares its signature with what the hook expects, so a drifted SGLang is caught
when the plugin registers (at server start-up), never on the first request.
"""

from __future__ import annotations

import inspect
import pkgutil
from dataclasses import dataclass

SUPPORTED_SGLANG = "0.5.23"


@dataclass(frozen=True)
class HookSpec:
    target: str  # dotted path of the SGLang function / method
    kind: str  # HookRegistry hook type: "around", "after", "before", "replace"
    hook: str  # "module:function" inside sgl_multilora.patches
    params: tuple[str, ...]  # parameter names of the target the hook relies on
    why: str


_LORA_MANAGER = "sglang.srt.lora.lora_manager.LoRAManager"

HOOKS: tuple[HookSpec, ...] = (
    HookSpec("sglang.srt.server_args.ServerArgs.add_cli_args", "around", "cli:add_cli_args", ("parser",),
             "add the --multilora-* flags to SGLang's parser"),
    HookSpec("sglang.srt.server_args.ServerArgs.from_cli_args", "around", "cli:from_cli_args", ("args",),
             "take the --multilora-* values out of the namespace and export them to every process"),
    HookSpec(f"{_LORA_MANAGER}.init_lora_modules", "around", "lora_transformers:init_lora_modules", ("self",),
             "apply LoRA on the --model-impl transformers path, which SGLang's LoRA layers do not reach"),
    HookSpec(f"{_LORA_MANAGER}._load_lora_adapter", "around", "lora_transformers:load_lora_adapter",
             ("self", "lora_ref"), "validate adapters (files, config, rank, target modules) with clear errors"),
    HookSpec(f"{_LORA_MANAGER}._unload_lora_adapter", "around", "lora_transformers:unload_lora_adapter",
             ("self", "lora_ref"), "drop an unloaded adapter's weights"),
    HookSpec(f"{_LORA_MANAGER}.fetch_new_loras", "around", "lora_transformers:fetch_new_loras",
             ("self", "new_loras"), "skip SGLang's slot copies on the path where its LoRA layers are not used"),
    HookSpec("sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new", "before",
             "lora_transformers:forward_batch_init_new", ("cls", "batch"),
             "see the batch's requests (aLoRA activation starts may lie in their cached prefix)"),
    HookSpec("sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request", "after",
             "alora_ingress:validate_one_request", ("self", "obj", "input_ids"),
             "HTTP 400 for an aLoRA request whose prompt lacks the adapter's invocation sequence"),
    HookSpec("sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_and_resolve_lora", "around",
             "ingress:validate_and_resolve_lora", ("self", "obj"),
             "HTTP 400 for a client-supplied lora_id: adapters are resolved by the server from lora_path"),
    HookSpec("sglang.srt.managers.io_struct.GenerateReqInput.normalize_batch_and_arguments", "after",
             "ingress:normalize_batch_and_arguments", ("self",),
             "HTTP 400 for a lora_path list that does not give one adapter per prompt (stock answers 500)"),
    HookSpec("sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request", "after",
             "ingress:validate_one_request", ("self", "obj", "input_ids"),
             "HTTP 400 for inputs that crash stock SGLang's scheduler: empty prompt, token ids outside the vocabulary, "
             "top_logprobs_num above it"),
    HookSpec("sglang.srt.managers.schedule_batch.Req.__init__", "after", "ingress:req_init",
             ("self", "extra_key", "lora_id"),
             "cache namespace = unambiguous (client extra_key, adapter content identity), not extra_key + lora_id"),
    HookSpec("sglang.srt.managers.scheduler.Scheduler._add_request_to_queue", "around",
             "ingress:add_request_to_queue", ("self", "req"),
             "finish a request whose adapter is not loaded with HTTP 400 instead of crashing the scheduler"),
    HookSpec("sglang.srt.managers.scheduler.Scheduler.get_internal_state", "after",
             "stats:scheduler_internal_state", ("self", "recv_req"), "add the tree's counters for /multilora/stats"),
    HookSpec("sglang.srt.entrypoints.http_server.launch_server", "before", "stats:add_routes", ("server_args",),
             "serve GET /multilora/stats"),
    HookSpec(f"{_LORA_MANAGER}.prepare_lora_batch", "around", "lora_transformers:prepare_lora_batch",
             ("self", "forward_batch"), "build the step's per-token adapter layout"),
    HookSpec("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend._run_sdpa_forward_extend",
             "around", "cpu_extend_attention:run_sdpa_forward_extend",
             ("self", "query", "output", "k_cache", "v_cache", "req_to_token", "req_pool_indices", "seq_lens",
              "extend_prefix_lens", "extend_seq_lens", "encoder_lens", "scaling", "enable_gqa", "causal",
              "is_cross_attn", "sliding_window_size"),
             "CPU extend attention for the new tokens only, not the cached prefix (stock recomputes it)"),
)


class IncompatibleSGLang(RuntimeError):
    pass


def check(hooks: tuple[HookSpec, ...] = HOOKS) -> None:
    """Raises IncompatibleSGLang naming the first target that is missing or has another signature."""
    for spec in hooks:
        try:
            owner_path, attr = spec.target.rsplit(".", 1)
            owner = pkgutil.resolve_name(owner_path)
            fn = inspect.getattr_static(owner, attr)
        except (ImportError, AttributeError, ValueError) as e:
            raise IncompatibleSGLang(
                f"hook target {spec.target} is missing in the installed SGLang ({type(e).__name__}: {e})"
            ) from None
        fn = getattr(fn, "__func__", fn)  # classmethod / staticmethod
        fn = inspect.unwrap(fn)
        try:
            names = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            names = []
        missing = [p for p in spec.params if p not in names]
        if missing:
            raise IncompatibleSGLang(
                f"hook target {spec.target} has parameters {names}; sgl_multilora expects {list(spec.params)}"
            )

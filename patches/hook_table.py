"""Every place the plugin touches SGLang (or torch, process-wide), in one table: what, of which kind, where, why.

Nothing outside this table reaches into SGLang: the hooks translate SGLang's objects into the core's types and ask
the process's state owners (`state.py`). `check()` resolves every target and compares its signature with what the
touch point relies on, so a drifted SGLang is caught when the plugin registers (at server start-up) or when the
frontend is imported, never on the first request.

Kinds:
- `hook`: SGLang's HookRegistry wraps the target (`hook_type` around / before / after); `plugin.register` applies it.
- `registry entry`: an entry added through SGLang's own registration function; `plugin.register` calls `impl`.
- `route`: an HTTP route added to SGLang's FastAPI app; installed by the `launch_server` hook (HTTP process only).
- `parser edit`: a change to an argument SGLang's parser already defines; made by the `add_cli_args` hook.
- `override`: a method of an SGLang class that a subclass of ours overrides (client-side frontend DSL).
- `process-wide patch`: an attribute replaced for the whole process (CPU-only torch builds only); installed by the
  start-up `.pth` hook of the CPU set-up and again by `plugin.register`. The GPU kit's rows (CUDA without
  sgl_kernel, `gpu_compat.py`) are installed by the kit's start-up `sitecustomize.py`.
"""

from __future__ import annotations

import inspect
import pkgutil
from dataclasses import dataclass
from enum import StrEnum

SUPPORTED_SGLANG = "0.5.23"


class Kind(StrEnum):
    HOOK = "hook"
    REGISTRY = "registry entry"
    ROUTE = "route"
    PARSER = "parser edit"
    OVERRIDE = "override"
    PROCESS_PATCH = "process-wide patch"


class Process(StrEnum):
    """Where a touch point takes effect."""

    ALL = "every server process"
    HTTP = "HTTP / tokenizer process"
    SCHEDULER = "scheduler process"
    CLIENT = "client (frontend DSL)"


@dataclass(frozen=True)
class TouchPoint:
    target: str  # dotted path of the SGLang (or torch) symbol touched
    kind: Kind
    impl: str  # "module:attribute" of our code that makes the touch (module relative to sgl_multilora)
    params: tuple[str, ...]  # parameter names of the target the touch relies on
    why: str
    process: Process = Process.SCHEDULER
    hook_type: str | None = None  # for Kind.HOOK: HookRegistry's "around", "before", "after", "replace"
    also: tuple[str, ...] = ()  # other symbols the touch relies on (resolved by `check`, signatures not compared)

    def __post_init__(self) -> None:
        assert (self.kind is Kind.HOOK) == (self.hook_type is not None), f"hook_type is for hooks only: {self}"


_LM = "sglang.srt.lora.lora_manager.LoRAManager"
_TM = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
_RE = "sglang.lang.backend.runtime_endpoint"


def _hook(target, hook_type, impl, params, why, process=Process.SCHEDULER) -> TouchPoint:
    return TouchPoint(target, Kind.HOOK, f"patches.{impl}", params, why, process, hook_type)


TOUCH_POINTS: tuple[TouchPoint, ...] = (
    # ---- flags ----------------------------------------------------------------------------------------------------
    _hook("sglang.srt.server_args.ServerArgs.add_cli_args", "around", "cli:add_cli_args", ("parser",),
          "add the --multilora-* flags to SGLang's parser", Process.ALL),
    _hook("sglang.srt.server_args.ServerArgs.from_cli_args", "around", "cli:from_cli_args", ("args",),
          "take the --multilora-* values out of the namespace and export them to every process", Process.ALL),
    TouchPoint("sglang.srt.server_args.ServerArgs.add_cli_args", Kind.PARSER, "patches.lora_backend:add_cli_choice",
               ("parser",), "add 'multilora' to --lora-backend's choices (SGLang's field lists its own backends)",
               Process.ALL, also=("sglang.srt.arg_groups.fields.lora",)),
    # ---- registries ---------------------------------------------------------------------------------------------
    TouchPoint("sglang.srt.mem_cache.registry.register_radix_cache_backend", Kind.REGISTRY,
               "patches.radix_backend:register", ("name", "factory"),
               "--radix-cache-backend multilora: SGLang's prefix-cache API on the LoRA-aware tree", Process.ALL,
               also=("sglang.srt.mem_cache.registry.get_radix_cache_factory",)),
    TouchPoint("sglang.srt.lora.backend.lora_registry.register_lora_backend", Kind.REGISTRY,
               "patches.lora_backend:register", ("name",),
               "--lora-backend multilora: SGLang's LoRA layers on our segmented kernels", Process.ALL,
               also=("sglang.srt.lora.backend.lora_registry.LORA_SUPPORTED_BACKENDS",)),
    # ---- LoRA on the transformers model path ----------------------------------------------------------------------
    _hook(f"{_LM}.init_lora_modules", "around", "lora_transformers:init_lora_modules", ("self",),
          "apply LoRA on the --model-impl transformers path, which SGLang's LoRA layers do not reach"),
    _hook(f"{_LM}._load_lora_adapter", "around", "lora_transformers:load_lora_adapter", ("self", "lora_ref"),
          "validate adapters (files, config, rank, target modules) with clear errors; register them"),
    _hook("sglang.srt.lora.lora.LoRAAdapter.normalize_qkv_proj", "before", "lora_load:fill_missing_qkv",
          ("self", "weight_names", "weights"),
          "zero weights for the q/k/v projections an adapter leaves out (SGLang reads v_proj unconditionally)"),
    _hook("sglang.srt.lora.lora_config.LoRAConfig.__init__", "after", "lora_load:resolve_pattern_targets",
          ("self", "path"), "a regex target_modules (PEFT's string form) becomes the modules the weights hold",
          Process.ALL),
    _hook(f"{_LM}._unload_lora_adapter", "around", "lora_transformers:unload_lora_adapter", ("self", "lora_ref"),
          "drop an unloaded adapter's weights and identity"),
    _hook(f"{_LM}.fetch_new_loras", "around", "lora_transformers:fetch_new_loras", ("self", "new_loras"),
          "skip SGLang's slot copies on the path where its LoRA layers are not used"),
    _hook("sglang.srt.lora.mem_pool.LoRAMemoryPool.init_buffers", "around", "lora_transformers:init_buffers",
          ("self", "base_model"), "allocate no slot buffers on the path where SGLang's LoRA layers are not used"),
    # ---- the unified pool under SGLang's layers (--lora-backend multilora) -----------------------------------------
    _hook("sglang.srt.lora.mem_pool.LoRAMemoryPool.load_lora_weight_to_buffer", "around",
          "lora_pool_layers:load_to_slot", ("self", "uid", "buffer_id", "lora_adapter"),
          "no copy into SGLang's slot buffers where the unified pool holds the adapters"),
    _hook("sglang.srt.lora.mem_pool.LoRAMemoryPool._clear_buffer_slot_for_base", "around",
          "lora_pool_layers:clear_slot", ("self", "buffer_id"), "placeholders hold nothing to clear"),
    _hook(f"{_LM}.update_lora_info", "around", "lora_pool_layers:update_lora_info", ("self",),
          "the backend learns SGLang's placeholders; adapters loaded at start-up get their pool host copies"),
    _hook("sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new", "before",
          "lora_transformers:forward_batch_init_new", ("cls", "batch"),
          "see the batch's requests (aLoRA activation starts may lie in their cached prefix)"),
    _hook(f"{_LM}.prepare_lora_batch", "around", "lora_transformers:prepare_lora_batch",
          ("self", "forward_batch"), "build the step's per-token adapter layout"),
    # ---- one pool for adapters and KV ---------------------------------------------------------------------------
    _hook("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_token_to_kv_pool_allocator",
          "around", "unified_memory:build_allocator", ("self", "sizes", "token_to_kv_pool"),
          "the unified pool (on with the tree): SGLang's token allocator over the pool adapters take their slots from"),
    # ---- admission (the unified pool and the multi-queue scheduler) --------------------------------------------
    _hook("sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill", "around",
          "admission:get_new_batch_prefill", ("self", "running_batch"),
          "per admission pass: pin running adapters, idle prefetch, the multi-queue plan and its re-queue"),
    _hook("sglang.srt.managers.scheduler.Scheduler.can_schedule_lora_req", "around",
          "admission:can_schedule_lora_req", ("self", "req", "running_loras"),
          "skip (the queue goes on) a request outside the plan or whose adapter is being copied in"),
    TouchPoint("sglang.srt.managers.scheduler.Scheduler.init_req_max_new_tokens", Kind.HOOK,
               "patches.admission:init_req_max_new_tokens", ("self", "req"),
               "find a request that can never fit beside its adapter in the unified pool (clip an unset generation)",
               Process.SCHEDULER, "around", also=("sglang.srt.managers.schedule_policy.CLIP_MAX_NEW_TOKENS",)),
    TouchPoint("sglang.srt.managers.scheduler.Scheduler._add_request_to_queue", Kind.HOOK,
               "patches.admission:refuse_infeasible", ("self", "req"),
               "answer a request that can never fit with HTTP 400 at once, never queue it", Process.SCHEDULER,
               "around", also=("sglang.srt.managers.scheduler._make_abort_req",
                               "sglang.srt.managers.scheduler.Scheduler.send_abort_output",
                               "sglang.srt.managers.scheduler.Scheduler._release_aborted_request")),
    _hook("sglang.srt.managers.schedule_policy.SchedulePolicy.calc_priority", "after", "admission:calc_priority",
          ("self", "waiting_queue"), "the pass meets the multi-queue plan's requests first, in the plan's order"),
    _hook("sglang.srt.managers.schedule_policy.PrefillAdder.__init__", "after", "admission:prefill_adder_init",
          ("self", "tree_cache", "token_to_kv_pool_allocator"),
          "an adapter load takes no more than the admission pass's prefill budget has left"),
    _hook("sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req", "around", "admission:add_one_req",
          ("self", "req"), "the multi-queue plan's gate on servers without LoRA"),
    _hook("sglang.srt.managers.scheduler.Scheduler._add_request_to_queue", "after",
          "admission:add_request_to_queue", ("self", "req"),
          "arrivals: the eviction policy's visit counts; the multi-queue scheduler's queues"),
    _hook("sglang.srt.managers.scheduler.Scheduler.run_batch", "after", "lora_remote:after_run_batch",
          ("self", "batch"), "--multilora-lora-server: a forward whose LoRA server call failed ends its adapter "
          "requests with HTTP 503 and keeps their KV out of the cache"),
    _hook("sglang.srt.managers.scheduler.Scheduler.process_batch_result", "after",
          "admission:process_batch_result", ("self", "batch", "result"),
          "step statistics, finished requests; memory and scheduler invariants in test mode"),
    # ---- request ingress ----------------------------------------------------------------------------------------
    _hook(f"{_TM}._validate_one_request", "after", "alora_ingress:validate_one_request",
          ("self", "obj", "input_ids"),
          "HTTP 400 for an aLoRA request whose prompt lacks the adapter's invocation sequence", Process.HTTP),
    TouchPoint(f"{_TM}.load_lora_adapter", Kind.HOOK, "patches.adapter_paths:load_lora_adapter", ("self", "obj"),
               "/load_lora_adapter: HTTP 400 revealing nothing for a path outside --multilora-adapter-root",
               Process.HTTP, "around", also=("sglang.srt.managers.io_struct.LoadLoRAAdapterReqOutput",)),
    TouchPoint(f"{_TM}._resolve_lora_path", Kind.HOOK, "patches.on_demand:resolve_lora_path", ("self", "obj"),
               "adapters on demand: a name no process has loaded is resolved from --multilora-adapter-source and "
               "loaded through SGLang's own load_lora_adapter (one load per name at a time); the host tier's budget "
               "unloads the least recently used; an unknown name's HTTP 400 does not list other adapters",
               Process.HTTP, "around", also=("sglang.srt.managers.io_struct.LoadLoRAAdapterReqInput",
                                             "sglang.srt.managers.io_struct.UnloadLoRAAdapterReqInput",
                                             f"{_TM}._unload_lora_adapter_locked")),
    _hook(f"{_TM}._release_lora_once", "after", "on_demand:release_lora_once", ("self", "state"),
          "the host tier's budget applied again when a request releases an adapter the last fit could not drop",
          Process.HTTP),
    _hook(f"{_TM}.unload_lora_adapter", "around", "on_demand:unload_lora_adapter", ("self", "obj"),
          "an adapter a user unloads is forgotten: SGLang 0.5.23 would reload it quietly from its old path",
          Process.HTTP),
    _hook(f"{_TM}._validate_and_resolve_lora", "around", "ingress:validate_and_resolve_lora", ("self", "obj"),
          "HTTP 400 for a client-supplied lora_id: adapters are resolved by the server from lora_path",
          Process.HTTP),
    _hook("sglang.srt.managers.io_struct.GenerateReqInput.normalize_batch_and_arguments", "after",
          "ingress:normalize_batch_and_arguments", ("self",),
          "HTTP 400 for a lora_path list that does not give one adapter per prompt (stock answers 500)",
          Process.HTTP),
    _hook(f"{_TM}._validate_one_request", "after", "ingress:validate_one_request", ("self", "obj", "input_ids"),
          "HTTP 400 for inputs that crash stock SGLang's scheduler: empty prompt, token ids outside the "
          "vocabulary, top_logprobs_num above it", Process.HTTP),
    _hook("sglang.srt.managers.schedule_batch.Req.__init__", "around", "ingress:req_init",
          ("self", "extra_key", "lora_id"),
          "cache namespace = unambiguous (client extra_key, adapter content identity), not extra_key + lora_id"),
    _hook("sglang.srt.managers.scheduler.Scheduler._add_request_to_queue", "around",
          "ingress:add_request_to_queue", ("self", "req"),
          "finish a request whose adapter is not loaded with HTTP 400 instead of crashing the scheduler"),
    # ---- /multilora/stats ---------------------------------------------------------------------------------------
    _hook("sglang.srt.managers.scheduler.Scheduler.get_internal_state", "after", "stats:scheduler_internal_state",
          ("self", "recv_req"), "add the tree's counters and memory by kind for /multilora/stats"),
    _hook("sglang.srt.entrypoints.http_server.launch_server", "before", "stats:add_routes", ("server_args",),
          "install the /multilora/stats and /multilora/metrics routes before the app starts", Process.HTTP),
    TouchPoint("sglang.srt.entrypoints.http_server.app", Kind.ROUTE, "patches.stats:add_routes", (),
               "GET /multilora/stats (JSON) and /multilora/metrics (Prometheus text): every scheduler's counters "
               "over SGLang's internal-state channel", Process.HTTP,
               also=("sglang.srt.entrypoints.http_server.get_global_state",
                     f"{_TM}.get_internal_state")),
    # ---- KV transfer between servers -----------------------------------------------------------------------------
    _hook("sglang.srt.managers.scheduler.Scheduler.get_internal_state", "after",
          "kv_transfer:scheduler_internal_state", ("self", "recv_req"),
          "run a KV export / import command (carried in the request's rid) in the scheduler loop"),
    _hook("sglang.srt.entrypoints.http_server.launch_server", "before", "kv_transfer:add_routes", ("server_args",),
          "install the admin routes /multilora/kv/export and /multilora/kv/import", Process.HTTP),
    TouchPoint("sglang.srt.entrypoints.http_server.app", Kind.ROUTE, "patches.kv_transfer:add_routes", (),
               "POST /multilora/kv/export, /multilora/kv/import: a request's cached KV out of one server's tree "
               "and into another's (admin key required)", Process.HTTP,
               also=("sglang.srt.entrypoints.http_server.get_global_state", "sglang.srt.entrypoints.http_server"
                     ".get_serving", "sglang.srt.utils.auth.auth_level",
                     "sglang.srt.managers.io_struct.GetInternalStateReq", f"{_TM}.auto_create_handle_loop")),
    # ---- chat completions the cluster's gateway can carry -----------------------------------------------------------
    _hook("sglang.srt.entrypoints.http_server.launch_server", "before", "chat_native:add_routes", ("server_args",),
          "install POST /multilora/chat/native", Process.HTTP),
    TouchPoint("sglang.srt.entrypoints.http_server.app", Kind.ROUTE, "patches.chat_native:add_routes", (),
               "POST /multilora/chat/native: an OpenAI chat completion as the native body the server's own chat "
               "route would run (its template, tokenizer and defaults), for the gateway to carry", Process.HTTP,
               also=("sglang.srt.entrypoints.openai.protocol.ChatCompletionRequest",
                     "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._convert_to_internal_request",
                     "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._validate_request",
                     "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._tool_call_parsing_active",
                     "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._encoding_output",
                     "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._should_return_input_ids",
                     "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._should_return_output_ids")),
    _hook("sglang.srt.managers.scheduler.Scheduler.process_batch_result", "after",
          "debug_checks:process_batch_result", ("self", "batch", "result"),
          "--multilora-check-invariants (test mode): the tree's invariants after every step"),
    # ---- MoE on a CPU ---------------------------------------------------------------------------------------------
    TouchPoint("sglang.srt.models.transformers.MoEMixin.recursive_replace", Kind.HOOK,
               "patches.moe_cpu:recursive_replace", ("self",),
               "on a CPU keep HF's MoE blocks (router, fused experts): SGLang's FusedMoE and its meta-parameter "
               "materialisation need a GPU", Process.SCHEDULER, "around",
               also=("sglang.srt.models.transformers.TransformersBase.recursive_replace",
                     "sglang.srt.runtime_context.get_server_args")),
    # ---- CPU attention ------------------------------------------------------------------------------------------
    _hook("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend._run_sdpa_forward_extend",
          "around", "cpu_extend_attention:run_sdpa_forward_extend",
          ("self", "query", "output", "k_cache", "v_cache", "req_to_token", "req_pool_indices", "seq_lens",
           "extend_prefix_lens", "extend_seq_lens", "encoder_lens", "scaling", "enable_gqa", "causal",
           "is_cross_attn", "sliding_window_size"),
          "CPU extend attention for the new tokens only, not the cached prefix (stock recomputes it)"),
    _hook("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend._run_sdpa_forward_decode",
          "around", "cpu_decode_attention:run_sdpa_forward_decode",
          ("self", "query", "output", "k_cache", "v_cache", "req_to_token", "req_pool_indices", "seq_lens",
           "encoder_lens", "scaling", "enable_gqa", "causal", "is_cross_attn", "sliding_window_size"),
          "CPU decode attention in one call per group of similar lengths (stock calls SDPA once per request)"),
    # ---- CPU-only torch builds ----------------------------------------------------------------------------------
    TouchPoint("torch.Tensor.pin_memory", Kind.PROCESS_PATCH, "patches.cpu_compat:install", (),
               "a CPU-only torch rejects pin_memory(), which SGLang's LoRA code calls; pinning is meaningless "
               "without a device, so it returns the tensor", Process.ALL),
    TouchPoint("torch.library.register_fake", Kind.PROCESS_PATCH, "patches.cpu_compat:install", (),
               "a no-op only while torchvision's top-level package executes: its C-op registrations fail on a "
               "CPU-only torch and SGLang imports torchvision unconditionally", Process.ALL),
    # ---- CUDA machines without sgl_kernel (the GPU kit: patches/gpu_compat.py) -------------------------------------
    TouchPoint("sglang.srt.utils.common.is_cuda", Kind.PROCESS_PATCH, "patches.gpu_compat:install", (),
               "where sgl_kernel is missing on CUDA, a stub package stands in for it (SGLang imports its ops at "
               "module import): the Llama path's ops in torch, any other op named when called", Process.ALL),
    TouchPoint("sglang.kernels.ops.activation.activation.silu_and_mul", Kind.PROCESS_PATCH,
               "patches.gpu_compat:install", (), "JIT activation kernels (tvm-ffi) replaced by torch ops", Process.ALL,
               also=("sglang.kernels.ops.activation.activation.gelu_and_mul",
                     "sglang.kernels.ops.activation.activation.gelu_tanh_and_mul")),
    TouchPoint("sglang.kernels.ops.layernorm.norm.fused_add_rmsnorm", Kind.PROCESS_PATCH, "patches.gpu_compat:install",
               (), "JIT fused add + RMSNorm replaced by a torch op", Process.ALL,
               also=("sglang.kernels.ops.layernorm.rmsnorm_hf.rmsnorm_hf",)),
    TouchPoint("sglang.kernels.ops.attention.rope.apply_rope_with_cos_sin_cache_inplace", Kind.PROCESS_PATCH,
               "patches.gpu_compat:install", (), "JIT RoPE replaced by a torch op", Process.ALL,
               also=("sglang.kernels.ops.attention.rope.rotary_embedding",)),
    TouchPoint("sglang.kernels.ops.kvcache.kvcache.can_use_store_cache", Kind.PROCESS_PATCH,
               "patches.gpu_compat:install", (), "answers False: KV is stored by plain indexing, not the JIT kernel",
               Process.ALL),
    TouchPoint("sglang.srt.models.utils.enable_fused_set_kv_buffer", Kind.PROCESS_PATCH, "patches.gpu_compat:install",
               (), "answers False: RoPE and the KV store run apart (no fused JIT kernel)", Process.ALL),
    TouchPoint("sglang.kernels.fused_op.get_fused_op_backend", Kind.PROCESS_PATCH, "patches.gpu_compat:install", (),
               "SGLANG_FORCE_FUSED_OP_BACKEND=torch (if unset): fused ops run their pure-torch forward_native",
               Process.ALL),
    # ---- frontend DSL (client side) -----------------------------------------------------------------------------
    TouchPoint(f"{_RE}.RuntimeEndpoint._add_images", Kind.OVERRIDE, "patches.frontend:MultiLoRAEndpoint",
               ("self", "s", "data"),
               "the one place every /generate body built from a program passes: it gets the call's lora_path",
               Process.CLIENT, also=(f"{_RE}.RuntimeEndpoint.generate", f"{_RE}.RuntimeEndpoint.generate_stream",
                                     f"{_RE}.RuntimeEndpoint._generate_http_request")),
    TouchPoint(f"{_RE}.RuntimeEndpoint.select", Kind.OVERRIDE, "patches.frontend:MultiLoRAEndpoint",
               ("self", "s", "choices", "temperature", "choices_method"),
               "adapter switches travel as unnamed selects, run in program order by the executor",
               Process.CLIENT, also=("sglang.lang.interpreter.StreamExecutor._execute_select",
                                     "sglang.lang.interpreter.ProgramState", "sglang.lang.api.gen",
                                     "sglang.lang.choices.ChoicesDecision", "sglang.lang.choices.ChoicesSamplingMethod",
                                     "sglang.lang.ir.SglExpr", "sglang.lang.ir.SglExprList", "sglang.lang.ir.SglSelect")),
    TouchPoint(f"{_RE}.RuntimeEndpoint.cache_prefix", Kind.OVERRIDE, "patches.frontend:MultiLoRAEndpoint",
               ("self", "prefix_str"), "prefill a prefix on a chosen adapter", Process.CLIENT,
               also=(f"{_RE}.http_request",)),
)

HOOKS: tuple[TouchPoint, ...] = tuple(t for t in TOUCH_POINTS if t.kind is Kind.HOOK)


class IncompatibleSGLang(RuntimeError):
    pass


def resolve(dotted: str):
    """The object at `dotted` (a module attribute or a class attribute, static: no descriptor is called)."""
    try:
        return pkgutil.resolve_name(dotted)
    except (ImportError, AttributeError, ValueError):
        owner_path, attr = dotted.rsplit(".", 1)
        return inspect.getattr_static(pkgutil.resolve_name(owner_path), attr)


def resolve_impl(impl: str):
    module, attr = impl.split(":")
    return pkgutil.resolve_name(f"sgl_multilora.{module}:{attr}")


def _parameters(obj) -> list[str]:
    fn = inspect.unwrap(getattr(obj, "__func__", obj))  # classmethod / staticmethod, hooks already applied
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def check(points: tuple[TouchPoint, ...] = TOUCH_POINTS) -> None:
    """Raises IncompatibleSGLang naming the first target that is missing or has another signature."""
    for point in points:
        for dotted in (point.target, *point.also):
            try:
                target = resolve(dotted)
            except (ImportError, AttributeError, ValueError) as e:
                raise IncompatibleSGLang(
                    f"{point.kind} target {dotted} is missing in the installed SGLang ({type(e).__name__}: {e})"
                ) from None
            if dotted != point.target or not point.params:
                continue
            names = _parameters(target)
            missing = [p for p in point.params if p not in names]
            if missing:
                raise IncompatibleSGLang(
                    f"{point.kind} target {dotted} has parameters {names}; sgl_multilora expects "
                    f"{list(point.params)}"
                )


def client_points() -> tuple[TouchPoint, ...]:
    """The touch points of the client-side frontend DSL (checked when `patches.frontend` is imported)."""
    return tuple(t for t in TOUCH_POINTS if t.process is Process.CLIENT)

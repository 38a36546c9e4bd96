"""SGLang frontend DSL programs that choose the adapter per `gen` call (client side; imports `sglang.lang`).

In the seam (patches/), not the core, because it subclasses SGLang's own classes.
Lives here: `MultiLoRAEndpoint`, a `RuntimeEndpoint` whose every `/generate` body carries `lora_path`; the two ways
a program names the adapter of a call, `with adapter(s, name):` and `gen(name, adapter=name, ...)`; and
`invocation_text`, the text that switches an aLoRA on. Not here: anything of the server, which loads the adapters
(`--lora-paths name=dir`, `--multilora-adapter-dir`) and shares the base prefix with aLoRA requests.

Example: base answer, an aLoRA check on the same context, base continuation::

    import sglang as sgl
    from sgl_multilora.patches.frontend import MultiLoRAEndpoint, adapter, gen, invocation_text

    endpoint = MultiLoRAEndpoint("http://127.0.0.1:30000")
    check = invocation_text(endpoint, "assets/adapters/check_caps")  # "<|im_start|>check_caps\n"

    @sgl.function
    def pipeline(s, question):
        s += "<|im_start|>user\n" + question + "<|im_end|>\n<|im_start|>assistant\n"
        s += sgl.gen("answer", max_tokens=32)              # base model
        s += "<|im_end|>\n" + check                        # the aLoRA's invocation is plain text
        with adapter(s, "check_caps"):                     # the aLoRA for the calls in the block
            s += sgl.gen("verdict", max_tokens=4)
        s += "<|im_end|>\n<|im_start|>user\nOne more fact?<|im_end|>\n<|im_start|>assistant\n"
        s += sgl.gen("more", max_tokens=32)                # base model again
        s += gen("shout", adapter="caps", max_tokens=16)   # one call on a standard LoRA

    state = pipeline.run(question="What is the capital of France?", backend=endpoint, temperature=0)
    print(state["answer"], state["verdict"], state.get_meta_info("verdict")["cached_tokens"])

Design. `s += sgl.gen(...)` only queues the call: a `StreamExecutor` worker thread runs the program's ops later, in
order. An adapter chosen by setting an attribute from the program's thread would therefore race with that worker
(the `with` block can end before its `gen` has run). So choosing an adapter is itself an op of the program: a
no-text select whose choices method is an `_AdapterSwitch` marker. The executor runs it in program order and, as for
every select, calls `backend.select(executor, ...)`; `MultiLoRAEndpoint.select` recognises the marker and pushes
(or pops) a name on that executor's adapter stack, which the endpoint keeps per executor (weakly referenced, so a
finished program's stack goes with it). Every body the endpoint builds from that executor names the top of the
stack (None = base model). Concurrent programs (`run_batch`) never see each other's choice, scopes nest, and
streaming (`run(stream=True)`) and `select` behave the same.

`RuntimeEndpoint` passes every `/generate` body it builds from an executor (`generate`, `generate_stream`, both
requests of `select`, `commit_lazy_operations`, `fill_image`) through `_add_images(s, data)` just before sending, so
that one override adds `lora_path` everywhere; `cache_prefix` has no executor and takes the adapter as an argument.
The overridden methods are rows of the plugin's touch-point table (`patches/hook_table.py`, kind "override"),
checked against the installed SGLang when this module is imported.

Semantics to know:
- A fork (`s.fork(n)`) starts on the base model: SGLang copies only its own fields into a fork. Name the adapter
  inside the fork (`forks += gen("x", adapter="caps")`). The fork's prefix commit uses the parent's adapter.
- An aLoRA scope must begin after the invocation text: the server answers 400 to an aLoRA request whose prompt
  lacks the invocation (so it does to `unconditional_likelihood_normalized` selects under an aLoRA, whose
  unconditional request holds the choices' tokens only).
- On a backend other than `MultiLoRAEndpoint` a program fails at its first adapter op (TypeError) instead of
  silently using the base model.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import requests
from sglang.lang.api import gen as sgl_gen
from sglang.lang.backend import runtime_endpoint as _runtime_endpoint
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
from sglang.lang.choices import ChoicesDecision, ChoicesSamplingMethod
from sglang.lang.interpreter import ProgramState, StreamExecutor
from sglang.lang.ir import SglExpr, SglExprList, SglSelect

from sgl_multilora.adapters import read_config
from sgl_multilora.patches import hook_table

_WRONG_BACKEND = "choosing an adapter per call needs sgl_multilora.patches.frontend.MultiLoRAEndpoint as backend"


class _AdapterSwitch(ChoicesSamplingMethod):
    """Marker op payload: push `name` on the executor's adapter stack, or pop it when `pop` is set."""

    def __init__(self, name: str | None = None, *, pop: bool = False):
        if name is not None and not isinstance(name, str):
            raise TypeError(f"an adapter is named by a str (or None for the base model), got {name!r}")
        self.name = name
        self.pop = pop

    def __call__(self, **kwargs: Any) -> ChoicesDecision:
        # Reached only when a backend other than MultiLoRAEndpoint runs the op as a real select.
        raise TypeError(_WRONG_BACKEND)

    def __repr__(self) -> str:
        return "AdapterPop()" if self.pop else f"AdapterPush({self.name!r})"


class _NoChoices(list):
    """The choices of an adapter op: empty for `MultiLoRAEndpoint`, which never reads them; any other backend
    iterates them while running the op as a real select and gets a clear error instead of a request with none."""

    def __iter__(self):
        raise TypeError(_WRONG_BACKEND)


def _switch_op(switch: _AdapterSwitch) -> SglSelect:
    """An unnamed select that appends no text: the executor runs it in program order, through `backend.select`."""
    return SglSelect(None, _NoChoices(), 0.0, switch)


def active_adapter(s: StreamExecutor | ProgramState) -> str | None:
    """The adapter the next request of `s` uses (None = base model). Read it from the executor's worker thread
    (the endpoint does): from the program's thread, ops still queued have not applied yet."""
    executor = s.stream_executor if isinstance(s, ProgramState) else s
    backend = getattr(executor, "backend", None)
    return backend.adapter_of(executor) if isinstance(backend, MultiLoRAEndpoint) else None


@contextmanager
def adapter(s: ProgramState, name: str | None) -> Iterator[ProgramState]:
    """Every request of `s` submitted inside the block uses adapter `name` (None = base model); scopes nest.

    Raises TypeError at once when the program runs on another backend than `MultiLoRAEndpoint`.
    """
    backend = getattr(getattr(s, "stream_executor", None), "backend", None)
    if backend is not None and not isinstance(backend, MultiLoRAEndpoint):
        raise TypeError(f"adapter() needs MultiLoRAEndpoint as backend, not {type(backend).__name__}")
    s += _switch_op(_AdapterSwitch(name))
    try:
        yield s
    finally:
        s += _switch_op(_AdapterSwitch(pop=True))


def gen(name: str | None = None, *, adapter: str | None = None, **gen_kwargs: Any) -> SglExpr:
    """`sgl.gen(name, **gen_kwargs)` run on `adapter` (None = base model) for this one call.

    With `choices=` it is a select under the adapter, as `sgl.gen` is. Usable anywhere `sgl.gen` is,
    including `forks += gen(...)`.
    """
    return SglExprList(
        [
            _switch_op(_AdapterSwitch(adapter)),
            sgl_gen(name, **gen_kwargs),
            _switch_op(_AdapterSwitch(pop=True)),
        ]
    )


class MultiLoRAEndpoint(RuntimeEndpoint):
    """A `RuntimeEndpoint` whose every `/generate` request carries the `lora_path` active for that call.

    It owns one adapter stack per executor (a list of names; None = base model), edited only by `select` when it
    runs an adapter op, so one endpoint serves any number of concurrent programs.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._stacks: weakref.WeakKeyDictionary[StreamExecutor, list[str | None]] = weakref.WeakKeyDictionary()
        self._stacks_lock = threading.Lock()

    def adapter_of(self, s: StreamExecutor) -> str | None:
        """The adapter of `s`'s next request (None = base model)."""
        with self._stacks_lock:
            stack = self._stacks.get(s)
            return stack[-1] if stack else None

    def _switch(self, s: StreamExecutor, switch: _AdapterSwitch) -> None:
        """Mutates `s`'s stack. Runs in the executor's worker thread, in program order."""
        with self._stacks_lock:
            stack = self._stacks.setdefault(s, [])
            if switch.pop:
                assert stack, "adapter scope closed more often than opened (an _AdapterSwitch op built by hand?)"
                stack.pop()
            else:
                stack.append(switch.name)

    def _add_images(self, s: StreamExecutor, data: dict) -> None:
        # Called by the base class on every body it builds from an executor, right before sending it.
        super()._add_images(s, data)
        data["lora_path"] = self.adapter_of(s)

    def select(self, s: StreamExecutor, choices, temperature, choices_method) -> ChoicesDecision:
        if isinstance(choices_method, _AdapterSwitch):
            self._switch(s, choices_method)
            return ChoicesDecision(decision="")  # appends no text and, unnamed, sets no variable
        return super().select(s, choices, temperature, choices_method)

    def cache_prefix(self, prefix_str: str, adapter: str | None = None) -> None:
        """Prefills `prefix_str` on `adapter` (None = base model) so that later requests reuse its KV."""
        data = {"text": prefix_str, "sampling_params": {"max_new_tokens": 0}, "lora_path": adapter}
        # Looked up at call time, the same function the base class sends with.
        res = _runtime_endpoint.http_request(
            self.base_url + "/generate", json=data, api_key=self.api_key, verify=self.verify
        )
        self._assert_success(res)


def invocation_text(tokenizer_or_endpoint: Any, adapter_dir: str | Path) -> str:
    """The text of the aLoRA at `adapter_dir`'s `alora_invocation_tokens`: append it to switch the adapter on.

    `tokenizer_or_endpoint` is a Hugging Face tokenizer of the base model or a `RuntimeEndpoint`, whose server
    decodes (`/detokenize`). Raises ValueError for a standard LoRA and `AdapterError` for an unreadable config.
    """
    config = read_config(adapter_dir)
    tokens = config.get("alora_invocation_tokens")
    if not tokens:
        raise ValueError(f"{str(adapter_dir)!r} is a standard LoRA: its config has no alora_invocation_tokens")
    if isinstance(tokenizer_or_endpoint, RuntimeEndpoint):
        endpoint = tokenizer_or_endpoint
        res = requests.post(
            endpoint.base_url + "/detokenize",
            json={"tokens": list(tokens), "skip_special_tokens": False},
            headers={"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else None,
            timeout=60,
        )
        endpoint._assert_success(res)
        return res.json()["text"]
    return tokenizer_or_endpoint.decode(list(tokens), skip_special_tokens=False)


hook_table.check(hook_table.client_points())  # raises IncompatibleSGLang on drift

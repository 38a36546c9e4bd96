"""Latency model at MoE scale: decode steps of a Mixture-of-Experts model on an instance of `gpus` GPUs, with expert
LoRA computed locally (coupled serving) or on a remote LoRA server (InfiniLoRA). All figures are simulated.

Lives here: `MoeModelSpec` (+ `MIXTRAL_8X7B`, `QWEN3_30B_A3B`), `MoeLatencyModel`, `ServerLoad` (the LoRA server's
shared pipeline, seen by every instance). Not here: the dense model's terms (`latency.py`, whose `Hardware` presets
this reads), the links (`link.py`: `NetLink`, `ServerLoader`), the systems (`systems/moe.py`).

Decode only (InfiniLoRA's TTFT is the decode engine's: queueing + the step that makes the first token; prefill runs
on other GPUs and its KV arrives with the request). A step of b tokens (one per decoding request, one per request
joining) over C context tokens, on g GPUs (weights and KV sharded over them; experts by expert parallelism):
    dense     = max(dense weight bytes / (g HBM), 2 dense_params b / (g F))                     F = peak x MFU
    per layer, with D(c) = E (1 - (1 - k/E)^c) the distinct experts c tokens reach (uniform routing, an assumption):
      experts = max(D(b) 3 h I 2B / (g HBM), 2 b k 3 h I / (g F))      split 2/3 gate_up, 1/3 down (their bytes)
      a2a     = 2 b k h 2B (g - 1)/g / NVLink                           EP dispatch + combine
    attention = C x KV bytes per token / (g HBM)
Expert LoRA, a LoRA on gate, up and down of every expert (A and B each, `expert_lora_bytes`), per routed row of an
adapter's tokens (rows = k x its tokens), per layer and call (gate_up, down), on G GPUs:
    lora_call = 2 kernels x launch + (sum_a D(c_a) x the call's LoRA bytes at rank r_a + rows x act bytes) / (G HBM)
      act bytes per row: gate_up 2B (h + 2 x 2I) (shrink reads x, expand read-modify-writes 2I), down 2B (I + 2h)
  coupled: G = g, serial with the base (S-LoRA adds the LoRA after the base GEMM): step += layers x (gu + down).
  remote (InfiniLoRA): per call, over min(g, x) NICs of `NetLink` (the client's and the server group's):
      T_recv = lat + rows x (h | I) 2B / (min(g, x) NIC);  T_send = lat + rows x (2I | h) 2B / (min(g, x) NIC);
      T_comp = lora_call on the group's x GPUs
      layer += max(experts_gu, T_recv + T_comp + T_send) + max(experts_down, ...)   (`overlap`; else their sums)
      server pipeline (receive || compute || send, one instance at a time, Eq 6): each of its y groups serves every
      y-th layer, so a step cannot be shorter than (layers / y) x sum over the instances in a step of
      [max(T_recv, T_comp, T_send)_gu + max(...)_down]  (`ServerLoad`).
Copies host->instance: latency + bytes / (g x PCIe) (each GPU copies its shard).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from eval.sim.latency import H100_SXM, Hardware, LatencyModel
from eval.sim.link import IB_400G, NVLINK, NetLink

EXPERT_MODULES = ("gate_proj", "up_proj", "down_proj")
"""The modules an expert LoRA targets, on every expert of every layer (the paper's adapters: seed-infinilora 1.2)."""


@dataclass(frozen=True)
class MoeModelSpec:
    """A MoE model's shapes (bf16). `num_params` total; `dense_params` everything but the experts (attention,
    router, norms, embeddings)."""

    name: str
    num_layers: int
    hidden: int
    num_experts: int
    top_k: int
    expert_ffn: int
    num_kv_heads: int
    head_dim: int
    num_params: float
    lora_rank: int
    dtype_bytes: int = 2

    @property
    def expert_params(self) -> int:
        """One expert of one layer: gate, up, down = 3 h I."""
        return 3 * self.hidden * self.expert_ffn

    @property
    def dense_params(self) -> float:
        return self.num_params - self.num_layers * self.num_experts * self.expert_params

    @property
    def active_params(self) -> float:
        return self.dense_params + self.num_layers * self.top_k * self.expert_params

    @property
    def weight_bytes(self) -> int:
        return int(self.num_params * self.dtype_bytes)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def lora_call_bytes(self, rank: int, call: str) -> int:
        """LoRA weights of one expert of one layer for one call: gate_up (A and B of gate and of up:
        2 r (h + I)) or down (r (I + h)), x 2 B."""
        h, i = self.hidden, self.expert_ffn
        return (2 if call == "gate_up" else 1) * rank * (h + i) * self.dtype_bytes

    def expert_lora_bytes(self, rank: int) -> int:
        """One expert of one layer, both calls: 3 r (h + I) x 2 B."""
        return self.lora_call_bytes(rank, "gate_up") + self.lora_call_bytes(rank, "down")

    def adapter_bytes(self, rank: int, target_modules: tuple[str, ...] = EXPERT_MODULES) -> int:
        """A LoRA on gate, up and down of every expert of every layer: layers x E x 3 r (h + I) x 2 B.
        Raises ValueError for other targets (attention LoRA is not part of the paper's adapters)."""
        if tuple(sorted(target_modules)) != tuple(sorted(EXPERT_MODULES)):
            raise ValueError(f"MoE adapters target {EXPERT_MODULES} of every expert, got {target_modules}")
        return self.num_layers * self.num_experts * self.expert_lora_bytes(rank)

    def shapes(self) -> str:
        return (f"{self.num_layers} layers, hidden {self.hidden}, {self.num_experts} experts top-{self.top_k}, "
                f"expert FFN {self.expert_ffn}, {self.num_kv_heads} KV heads x {self.head_dim}, "
                f"{self.num_params / 1e9:.1f} B params, LoRA rank {self.lora_rank}")


MIXTRAL_8X7B = MoeModelSpec("Mixtral-8x7B", num_layers=32, hidden=4096, num_experts=8, top_k=2, expert_ffn=14336,
                            num_kv_heads=8, head_dim=128, num_params=46.7e9, lora_rank=64)
"""Mixtral-8x7B-v0.1's config.json (hidden 4096, intermediate 14336, 32 layers, 8 KV heads of 128, 8 experts top-2;
46.7 B parameters); rank 64 as the paper's Tab 3: adapters of 1.81 GB (1.6875 GiB, the paper's "1.69 GB")."""
QWEN3_30B_A3B = MoeModelSpec("Qwen3-30B-A3B", num_layers=48, hidden=2048, num_experts=128, top_k=8, expert_ffn=768,
                             num_kv_heads=4, head_dim=128, num_params=30.5e9, lora_rank=16)
"""Qwen3-30B-A3B's config.json (hidden 2048, moe_intermediate 768, 48 layers, 4 KV heads of 128, 128 experts top-8;
30.5 B parameters). Rank 16, not the paper's Tab 3 rank 32: separate A/B at rank 32 give 3.32 GB, which does not
fit the paper's own server capacity (32 adapters per 96 GB GPU, seed-infinilora 5.2); rank 16 gives 1.66 GB, the
~1.69 GB adapter size the brief gives for it."""
MODELS = {"mixtral": MIXTRAL_8X7B, "qwen3": QWEN3_30B_A3B}

LoRABatch = Sequence[tuple]
"""(tokens, rank, groups, weight bytes) per adapter, as the engine builds it (latency.LoRABatch)."""


class ServerLoad:
    """The LoRA server's pipeline, shared by the instances of one InfiniLoRA run: each instance's latest step's
    bottleneck-stage seconds per layer and when that step ends. `clock()`: the simulated now (the driver's)."""

    def __init__(self, groups: int, clock: Callable[[], float] = lambda: 0.0) -> None:
        self.groups = groups  # y: pipeline groups (layers interleaved over them)
        self.clock = clock
        self.busy: dict[int, tuple[float, float]] = {}  # instance -> (stage seconds per layer, step end)

    def others(self, instance: int, now: float) -> float:
        """Stage seconds per layer of the other instances whose step is under way at `now`."""
        return sum(s for j, (s, end) in self.busy.items() if j != instance and end > now)


@dataclass(frozen=True)
class MoeLatencyModel(LatencyModel):
    """`gpus`: GPUs per instance. `lora_mode`: "local" (coupled), "remote" (InfiniLoRA) or "none".
    Remote only: `server_x` (GPUs per group, experts split over them), `server_y` (groups), `link`, `overlap` (the
    round trip hidden under the base grouped GEMM), `server` (a shared `ServerLoad`; None: this instance alone)
    and `instance` (its index there)."""

    model: MoeModelSpec = MIXTRAL_8X7B
    hw: Hardware = H100_SXM
    lora_cost: str = "roofline"
    gpus: int = 2
    lora_mode: str = "local"
    kernel_launch_s: float = 4e-6
    nvlink: NetLink = NVLINK
    server_x: int = 4
    server_y: int = 1
    link: NetLink = IB_400G
    overlap: bool = True
    server: ServerLoad | None = field(default=None, compare=False)
    instance: int = 0
    decode_only: bool = True

    def __post_init__(self) -> None:
        if self.lora_mode not in ("local", "remote", "none"):
            raise ValueError(f"lora_mode must be local, remote or none, got {self.lora_mode!r}")

    @property
    def device(self) -> str:
        return (f"simulated: {self.model.name} bf16, {self.gpus} GPU(s) per instance "
                f"({self.hw.hbm_total_bytes / 2**30:.0f} GiB, {self.hw.hbm_bytes_per_s / 1e12:.2f} TB/s each)")

    # ---- pieces (seconds) ---------------------------------------------------------------------------------

    def distinct_experts(self, tokens: float) -> float:
        """D(c) = E (1 - (1 - k/E)^c): experts reached by c tokens routed uniformly."""
        m = self.model
        return m.num_experts * (1.0 - (1.0 - m.top_k / m.num_experts) ** tokens) if tokens > 0 else 0.0

    def expert_layer_s(self, b: int) -> float:
        """One layer's base expert GEMMs (both calls) for b tokens."""
        m, g = self.model, self.gpus
        mem = self.distinct_experts(b) * m.expert_params * m.dtype_bytes / (g * self._hbm)
        flops = 2 * b * m.top_k * m.expert_params / (g * self._flops)
        return max(mem, flops)

    def a2a_layer_s(self, b: int) -> float:
        m, g = self.model, self.gpus
        return 2 * b * m.top_k * m.hidden * m.dtype_bytes * (g - 1) / g / self.nvlink.bytes_per_s

    def base_step_s(self, b: int, context_tokens: int) -> float:
        """The step without LoRA: dense + layers x (experts + a2a) + attention."""
        m, g = self.model, self.gpus
        dense = max(m.dense_params * m.dtype_bytes / (g * self._hbm), 2 * m.dense_params * b / (g * self._flops))
        attention = context_tokens * m.kv_bytes_per_token / (g * self._hbm)
        return dense + m.num_layers * (self.expert_layer_s(b) + self.a2a_layer_s(b)) + attention

    def _rows_and_weights(self, lora: LoRABatch, call: str) -> tuple[int, float]:
        m = self.model
        rows = sum(e[0] for e in lora) * m.top_k
        weights = sum(self.distinct_experts(e[0]) * m.lora_call_bytes(e[1], call) for e in lora if e[0])
        return rows, weights

    def lora_call_s(self, lora: LoRABatch, call: str, gpus: int) -> float:
        """One layer's LoRA kernels for one call (gate_up or down) on `gpus` GPUs; 0 without adapter tokens."""
        m = self.model
        rows, weights = self._rows_and_weights(lora, call)
        if not rows:
            return 0.0
        act = (m.hidden + 4 * m.expert_ffn if call == "gate_up" else m.expert_ffn + 2 * m.hidden) * m.dtype_bytes
        return 2 * self.kernel_launch_s + (weights + rows * act) / (gpus * self._hbm)

    def remote_stages(self, lora: LoRABatch, call: str) -> tuple[float, float, float]:
        """(T_recv, T_comp, T_send) of one layer's call at the server; zeros without adapter tokens."""
        m = self.model
        rows = sum(e[0] for e in lora) * m.top_k
        if not rows:
            return 0.0, 0.0, 0.0
        nic = min(self.gpus, self.server_x) * self.link.bytes_per_s
        out_w, back_w = (m.hidden, 2 * m.expert_ffn) if call == "gate_up" else (m.expert_ffn, m.hidden)
        recv = self.link.latency_s + rows * out_w * m.dtype_bytes / nic
        send = self.link.latency_s + rows * back_w * m.dtype_bytes / nic
        return recv, self.lora_call_s(lora, call, self.server_x), send

    # ---- the engine's interface ---------------------------------------------------------------------------

    def step_time(self, prefill_tokens: int, prefill_pairs: float, decode_tokens: int,
                  decode_context_tokens: int, lora: LoRABatch = (), prefill_requests: int | None = None) -> float:
        """A decode step (module docstring). Joining requests (`prefill_requests`; 1 if unknown and
        `prefill_tokens` > 0) make their first token in it and read their prompts' KV (`prefill_tokens`)."""
        joining = prefill_requests if prefill_requests is not None else int(prefill_tokens > 0)
        b = decode_tokens + joining
        if b == 0:
            return 0.0
        m = self.model
        base = self.base_step_s(b, decode_context_tokens + prefill_tokens)
        if self.lora_mode == "none" or not any(e[0] for e in lora):
            return base + self.hw.step_overhead_s
        if self.lora_mode == "local":
            lora_s = m.num_layers * (self.lora_call_s(lora, "gate_up", self.gpus)
                                     + self.lora_call_s(lora, "down", self.gpus))
            return base + lora_s + self.hw.step_overhead_s
        return self.remote_step_s(b, base, lora) + self.hw.step_overhead_s

    def remote_step_s(self, b: int, base: float, lora: LoRABatch) -> float:
        """InfiniLoRA's step: the round trips replace (overlap) or add to the expert GEMMs; the server pipeline
        bounds it from below; records this step's stage time in `server`."""
        m = self.model
        exp = self.expert_layer_s(b)
        gu, dn = self.remote_stages(lora, "gate_up"), self.remote_stages(lora, "down")
        if self.overlap:
            layer_extra = max(exp * 2 / 3, sum(gu)) + max(exp / 3, sum(dn)) - exp
        else:
            layer_extra = sum(gu) + sum(dn)
        step = base + m.num_layers * layer_extra
        stage = max(gu) + max(dn)
        if self.server is not None:
            now = self.server.clock()
            pipeline = m.num_layers / self.server.groups * (stage + self.server.others(self.instance, now))
            step = max(step, pipeline)
            self.server.busy[self.instance] = (stage, now + step)
        return step

    def lora_time(self, lora: LoRABatch) -> float:
        """Coupled LoRA seconds of a step (both calls, every layer)."""
        return self.model.num_layers * (self.lora_call_s(lora, "gate_up", self.gpus)
                                        + self.lora_call_s(lora, "down", self.gpus))

    def recompute_s_per_token(self) -> float:
        return 2 * self.model.active_params / (self.gpus * self._flops)

    def h2d_time(self, num_bytes: int) -> float:
        """Each of the instance's GPUs copies its shard over its own PCIe link."""
        return self.hw.pcie_latency_s + num_bytes / (self.gpus * self.hw.pcie_bytes_per_s)

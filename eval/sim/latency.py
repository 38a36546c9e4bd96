"""Latency model: step time of a continuous batch and host->GPU copy time, Llama-3-8B on one H100 SXM, PCIe 5.

Lives here: `SimModelSpec`, `Hardware`, `LatencyModel` with every constant's source. Not here: memory budgets
(`memory.py`) or scheduling (`engine.py`). All times in seconds, sizes in bytes.

A step runs one batch: chunked-prefill tokens and one decode token per decoding request (SGLang-style mixed
batches). Its time is a roofline sum (shared/reference/perf-anchors.md, sections 1, 2 and 5):
    linear    = max(weight bytes / HBM, (prefill + decode tokens) * 2 * params / (peak FLOPs * MFU))
    attention = 4 * layers * hidden * (query-key pairs of the prefill chunks) / (peak FLOPs * MFU)
              + (context tokens of the decoding requests) * KV bytes per token / HBM
    lora      = layers * (our segmented kernels' microseconds for one layer's module groups, fitted to an H100's
                measurements of them: eval/sim/lora_cost.py, eval/results/lora_step_gpu/lora_step_gpu.md)
                [`lora_cost="roofline"`, the estimate before the measurement: launch floor (if any token uses an
                adapter) + (bytes of the distinct adapters in the batch + adapter tokens * activation bytes) / HBM]
    step      = linear + attention + lora + step overhead
Every arm is costed with the same kernels (ours): the simulator compares scheduling and memory, not kernels.
Copies: `latency + bytes / PCIe bandwidth`, on one FIFO link, overlapped with compute (async streams).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MODULE_SHAPES = {
    "q_proj": (4096, 4096), "k_proj": (4096, 1024), "v_proj": (4096, 1024), "o_proj": (4096, 4096),
    "gate_proj": (4096, 14336), "up_proj": (4096, 14336), "down_proj": (14336, 4096),
}
"""Llama-3-8B linear layers (h_in, h_out): hidden 4096, 8 KV heads x 128, intermediate 14336."""


@dataclass(frozen=True)
class SimModelSpec:
    """The simulated served model's size and attention shape, Llama-3-8B, bf16 (perf-anchors.md 2.2): 8.03 B
    parameters, 32 layers, GQA 8 x 128. Not sgl_multilora.adapters.ModelShape (a served model's LoRA targets)."""

    num_params: float = 8.03e9
    weight_bytes: int = 16_060_000_000  # 8.03 B x 2 bytes
    num_layers: int = 32
    hidden: int = 4096
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer: 2 x 32 x 8 x 128 x 2 B = 131,072 B (128 KiB)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def adapter_bytes(self, rank: int, target_modules: tuple[str, ...]) -> int:
        """LoRA A and B of every targeted module in every layer: rank x sum(h_in + h_out) x layers x 2 B.
        q/k/v/o at rank 32: 54.5 MB (seed-elora.md A2); all seven modules: 5.24 MB x rank (perf-anchors 2.2).
        Raises ValueError naming an unknown module."""
        unknown = [m for m in target_modules if m not in MODULE_SHAPES]
        if unknown:
            raise ValueError(f"unknown target modules {unknown} for Llama-3-8B; known: {list(MODULE_SHAPES)}")
        per_rank = sum(sum(MODULE_SHAPES[m]) for m in target_modules)
        return rank * per_rank * self.num_layers * self.dtype_bytes


@dataclass(frozen=True)
class Hardware:
    """One H100 SXM 80 GB on PCIe 5 (perf-anchors.md section 1).

    - hbm_bytes_per_s 3.35e12 (spec) x hbm_efficiency 0.85 ("plan on about 85-90% of nominal").
    - peak_flops 989.5e12 (bf16 dense) x mfu 0.6 (prefill at 60% MFU: ~27 us/token for 8B, section 5).
    - pcie_bytes_per_s 50e9: PCIe 5 H2D with the copy engine on pinned memory, the planning figure of
      perf-anchors section 1 (measured SM-copy 35.2 GB/s on an H100; InfiniLoRA assumes ~50 GB/s; ELORA's
      "128 GB/s" is both directions). pcie_latency_s 10 us per copy: an assumption (launch + sync).
    - lora_launch_floor_s 256 kernels x 4 us = 1.02 ms per step with any adapter token (section 2.4: fused
      qkv / gate_up shrink + expand, 32 layers, 3-5 us each); `lora_cost="roofline"` only.
    - lora_act_bytes_per_token 7.2e6: shrink reads + expand read-modify-write per adapter token (section 2.2);
      `lora_cost="roofline"` only.
    - step_overhead_s 0: scheduling is overlapped with the GPU step (SGLang's overlap scheduler); an assumption.
    - hbm_total_bytes 81,559 MiB (an H100 80 GB as nvidia-smi reports it).
    """

    hbm_bytes_per_s: float = 3.35e12
    hbm_efficiency: float = 0.85
    peak_flops: float = 989.5e12
    mfu: float = 0.6
    pcie_bytes_per_s: float = 50e9
    pcie_latency_s: float = 10e-6
    lora_launch_floor_s: float = 256 * 4e-6
    lora_act_bytes_per_token: float = 7.2e6
    step_overhead_s: float = 0.0
    hbm_total_bytes: int = 81_559 * 2**20


H100_SXM = Hardware()
"""An H100 SXM 80 GB (the defaults above)."""
H200_SXM = Hardware(hbm_bytes_per_s=4.8e12, hbm_total_bytes=143_771 * 2**20)
"""An H200 SXM 141 GB: HBM3e 4.8 TB/s and 141 GB (NVIDIA's H200 datasheet; nvidia-smi shows 143,771 MiB), the same
Hopper compute as the H100 SXM (989.5 TFLOP/s bf16 dense); PCIe 5 and the efficiencies as the H100's."""
H20 = Hardware(hbm_bytes_per_s=4.0e12, peak_flops=148e12, hbm_total_bytes=97_871 * 2**20)
"""An H20 96 GB, the InfiniLoRA paper's testbed GPU (seed-infinilora.md 5.1: "Hopper GPUs (96 GB)", 4.0 TB/s HBM):
148 TFLOP/s bf16 dense (NVIDIA's H20 figure, outside the paper). Used only to check the MoE model against the
paper's Tab 4 (eval/sim/moe_latency.py)."""
HARDWARE = {"h100": H100_SXM, "h200": H200_SXM, "h20": H20}


LoRABatch = Sequence[tuple[int, int, frozenset[str], int]]
"""A step's adapters: (tokens, rank, module groups targeted, weight bytes) each (eval/sim/lora_cost.py GROUPS)."""

LORA_COSTS = ("measured", "roofline")
LORA_COST_HELP = ("the simulator's LoRA step term: measured (fitted to our kernels on an H100, "
                  "eval/results/lora_step_gpu/lora_step_gpu.md) or roofline (the estimate before that measurement)")


@dataclass(frozen=True)
class LatencyModel:
    """`lora_cost`: "measured" (the fit to our kernels on an H100) or "roofline" (the estimate it replaced, kept to
    reproduce results made with it)."""

    model: SimModelSpec = SimModelSpec()
    hw: Hardware = Hardware()
    lora_cost: str = "measured"

    def __post_init__(self) -> None:
        if self.lora_cost not in LORA_COSTS:
            raise ValueError(f"unknown lora_cost {self.lora_cost!r}; choose one of {', '.join(LORA_COSTS)}")

    @property
    def _hbm(self) -> float:
        return self.hw.hbm_bytes_per_s * self.hw.hbm_efficiency

    @property
    def _flops(self) -> float:
        return self.hw.peak_flops * self.hw.mfu

    @property
    def device(self) -> str:
        """The simulated device and LoRA term, for results files."""
        lora = ("LoRA term fitted to our kernels measured on an H100, eval/results/lora_step_gpu/lora_step_gpu.md"
                if self.lora_cost == "measured" else "LoRA term a roofline estimate")
        return f"simulated: Llama-3-8B bf16 on one H100 SXM 80 GB, PCIe 5 (eval/sim/latency.py; {lora})"

    def step_time(self, prefill_tokens: int, prefill_pairs: float, decode_tokens: int,
                  decode_context_tokens: int, lora: LoRABatch = ()) -> float:
        """Seconds for one batch step (formula in the module docstring).

        `prefill_pairs`: sum over prefill chunks of n * c + n * (n + 1) / 2 (a chunk of n new tokens after c
        cached ones attends to that many query-key pairs). `decode_context_tokens`: sum of the decoding
        requests' context lengths. `lora`: the step's adapters and their tokens (`LoRABatch`). An empty step
        takes 0 s."""
        tokens = prefill_tokens + decode_tokens
        if tokens == 0:
            return 0.0
        m, hw = self.model, self.hw
        linear = max(m.weight_bytes / self._hbm, tokens * 2 * m.num_params / self._flops)
        attention = (4 * m.num_layers * m.hidden * prefill_pairs / self._flops
                     + decode_context_tokens * m.kv_bytes_per_token / self._hbm)
        return linear + attention + self.lora_time(lora) + hw.step_overhead_s

    def lora_time(self, lora: LoRABatch) -> float:
        """Seconds of a step's LoRA work (`LoRABatch`); 0 when no token uses an adapter."""
        if not any(entry[0] for entry in lora):
            return 0.0
        if self.lora_cost == "roofline":
            tokens = sum(entry[0] for entry in lora)
            weights = sum(entry[3] for entry in lora if entry[0])
            return self.hw.lora_launch_floor_s + (weights + tokens * self.hw.lora_act_bytes_per_token) / self._hbm
        from eval.sim.lora_cost import measured_model

        return self.model.num_layers * measured_model().layer_us(lora) * 1e-6

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0, lora: LoRABatch = ()) -> float:
        """One request's prefill alone in a step (no decode tokens); `lora`: its adapter, as (n, rank, groups,
        bytes) with n its new tokens."""
        n, c = new_tokens, cached_tokens
        return self.step_time(n, n * c + n * (n + 1) / 2, 0, 0, lora)

    def recompute_s_per_token(self) -> float:
        """Linear-layer prefill seconds per token at large batch: 2 x params / (peak x MFU), ~27 us."""
        return 2 * self.model.num_params / self._flops

    def h2d_time(self, num_bytes: int) -> float:
        """One host->GPU copy of `num_bytes` over PCIe."""
        return self.hw.pcie_latency_s + num_bytes / self.hw.pcie_bytes_per_s

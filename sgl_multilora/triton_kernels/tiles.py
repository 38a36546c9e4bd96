"""The segmented kernels' tile rules (token block, rank tile), in plain Python: the launchers (`shrink.py`,
`expand.py`) read them, and so does the simulator's cost model (eval/sim/lora_cost.py) without importing torch.
"""

from __future__ import annotations

MIN_BLOCK = 16  # tl.dot needs every block dimension >= 16


def token_block(max_tokens: int, num_slots: int) -> int:
    """BLOCK_M: 16 for decode-sized steps, or when the tokens are spread thin over many slots (a block of 64 rows
    would be mostly masked), else 64."""
    return 16 if max_tokens <= 64 or max_tokens <= 16 * num_slots else 64


TARGET_PROGRAMS = 256  # about two waves on a 132-SM H100 / H200
RANK_CHUNK = 32
"""The widest rank tile one program computes. The kernels tile every slot of a launch at one width, so without a
cap a batch mixing ranks 8..128 computed every adapter at 128 (measured on an H100: as slow as all at rank 128);
above the cap, shrink splits the rank over programs and expand loops over it, each slot over its own rank's tiles
only. 32 against 64 and no cap (128), interleaved on an H100 over 1,056 shapes and 40 whole layers, chosen by the
lowest geometric mean: eval/results/lora_step_gpu.md."""


def rank_tile(max_rank: int) -> int:
    """BLOCK_R: the largest rank rounded up to a power of two (at least MIN_BLOCK), at most RANK_CHUNK (read at call
    time: a benchmark may set it)."""
    return min(max(MIN_BLOCK, 1 << (max(max_rank, 1) - 1).bit_length()), max(MIN_BLOCK, RANK_CHUNK))


ONE_TILE_PATH = True
"""Launches whose largest rank fits one rank tile (every launch of ranks <= RANK_CHUNK) compile the kernels without
the rank split and loop: the compiler then sees a rank offset of zero and a single tile. Measured against the general
path on an H200, interleaved (eval/results/rank_tile_ab.md): 0.91x median over 211 shapes of ranks 8-32 (prefill
0.58-0.87x), rank 64 (the same launch in both arms) 1.00x. Off, every launch runs the general path (read at call
time: the benchmark `eval/bench/rank_tile_ab.py` sets it)."""


def one_tile(max_rank: int) -> bool:
    """Whether a launch of this largest rank takes the one-tile path."""
    return ONE_TILE_PATH and max(max_rank, 1) <= rank_tile(max_rank)


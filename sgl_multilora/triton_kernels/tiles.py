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
cap a batch mixing ranks 8..128 computes every adapter at 128; above the cap, shrink splits the rank over programs and expand loops over it, each slot over its own rank's tiles
only. 32 was chosen against 64 and no cap (128) by the lowest geometric mean over a grid of shapes and whole layers
(measured: eval/RESULTS.md, kernels)."""


def rank_tile(max_rank: int) -> int:
    """BLOCK_R: the largest rank rounded up to a power of two (at least MIN_BLOCK), at most RANK_CHUNK (read at call
    time: a benchmark may set it)."""
    return min(max(MIN_BLOCK, 1 << (max(max_rank, 1) - 1).bit_length()), max(MIN_BLOCK, RANK_CHUNK))


ONE_TILE_PATH = True
"""Launches whose largest rank fits one rank tile (every launch of ranks <= RANK_CHUNK) compile the kernels without
the rank split and loop: the compiler then sees a rank offset of zero and a single tile (against the general path:
eval/RESULTS.md, kernels). Off, every launch runs the general path (read at call
time: the benchmark `eval/bench/rank_tile_ab.py` sets it)."""


def one_tile(max_rank: int) -> bool:
    """Whether a launch of this largest rank takes the one-tile path."""
    return ONE_TILE_PATH and max(max_rank, 1) <= rank_tile(max_rank)


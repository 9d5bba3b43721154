"""What the flash kernels share: the head-size rules, the autotuners' length key, and three Triton helpers.

The forward (``mha_lab.cuda.flash``) and the backward (``mha_lab.cuda.flash_backward``) work in the
same tiles: a head size padded to a power of two, tiles loaded with masks only where a block is
ragged, one program per (block, batch x head) with GQA's key/value head found by division, and a
key loop split into an unmasked bulk and a masked causal band. Whether Triton's CPU interpreter
runs the kernels (``TRITON_INTERPRET=1``) is read once, when this module is imported, as
``@triton.jit`` does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

__all__ = ["INTERPRET", "MIN_HEAD_DIM", "MAX_HEAD_DIM", "block_d", "check_head_dim", "dot_precision",
           "length_bucket", "tile_list", "autotune_configs", "pruner", "load_tile", "program_heads", "key_ranges"]

Tile = tuple[int, int, int, int]  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
INTERPRETER_TILE: Tile = (16, 16, 1, 1)  # small, so that test-sized inputs still span several blocks and tails

INTERPRET = triton.knobs.runtime.interpret
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 128


def block_d(head_dim: int) -> int:
    """The head size the kernel works in: the next power of two, at least 16 (``tl.arange`` needs one)."""
    return max(triton.next_power_of_2(head_dim), MIN_HEAD_DIM)


def length_bucket(seq_len: int) -> int:
    """The autotuners' length key: the next power of two, at least 1024, so that a tile is timed once per
    octave of lengths (short sequences fill the GPU with fewer programs than long ones) and not per length."""
    return max(triton.next_power_of_2(seq_len), 1024)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: IEEE for 4- and 8-byte floats (no TF32 rounding); 16-bit types ignore it."""
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def check_head_dim(head_dim: int) -> None:
    """Raise a ValueError naming the range unless MIN_HEAD_DIM <= ``head_dim`` <= MAX_HEAD_DIM."""
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head size D={head_dim} is not supported: the kernel takes "
                         f"{MIN_HEAD_DIM} <= D <= {MAX_HEAD_DIM}")


def tile_list(tiles: dict[str, list[Tile]], dtype: torch.dtype, head_dim: int) -> list[Tile]:
    """The list of ``tiles`` (keyed "16-bit, D <= 64", "32-bit, D > 64", ...) for inputs of ``dtype`` and head size
    ``head_dim``."""
    check_head_dim(head_dim)
    width = "32-bit" if dtype.itemsize >= 4 else "16-bit"
    return tiles[f"{width}, D {'<=' if block_d(head_dim) <= 64 else '>'} 64"]


def autotune_configs(tiles: dict[str, list[Tile]]) -> list[triton.Config]:
    """Every distinct tile of ``tiles`` as an autotuner config; under the interpreter, ``INTERPRETER_TILE`` alone."""
    chosen = [INTERPRETER_TILE] if INTERPRET else list(dict.fromkeys(t for ts in tiles.values() for t in ts))
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st) for m, n, w, st in chosen]


def pruner(candidates: Callable[[torch.dtype, int], list[Tile]]) -> Callable[..., list[triton.Config]]:
    """Autotuner hook: keep only the configs that ``candidates(dtype, head_dim)`` lists for this launch."""

    def prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        wanted = candidates(named_args["Q"].dtype, kwargs["HEAD_DIM"])
        return [c for c in configs
                if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in wanted]

    return prune


@triton.jit
def load_tile(ptrs, rows, n_rows, cols, n_cols, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """Load a (rows, cols) tile, zero-filling rows >= n_rows and columns >= n_cols where asked."""
    if CHECK_ROWS and CHECK_COLS:
        tile = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)
    elif CHECK_ROWS:
        tile = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    elif CHECK_COLS:
        tile = tl.load(ptrs, mask=cols[None, :] < n_cols, other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def program_heads(H, N_REP):
    """Split this program's row of the grid's second axis, (batch, query head) flattened, into
    (off_bh, off_b, off_h, off_h_kv): query head ``off_h`` reads key/value head ``off_h_kv`` (GQA/MQA)."""
    off_bh = tl.program_id(1)
    off_h = off_bh % H
    return off_bh, off_bh // H, off_h, off_h // N_REP


@triton.jit
def key_ranges(start_m, L, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """The key loop of query tile ``start_m``: keys [0, unmasked_end) need no mask, [unmasked_end, masked_end) do.

    Causal: keys before the tile's first query are visible to every row; the band up to its last
    query needs the mask; keys after it are skipped. Otherwise only a ragged last key block is masked.
    """
    if CAUSAL:
        unmasked_end = start_m * BLOCK_M
        masked_end = tl.minimum((start_m + 1) * BLOCK_M, L)
    else:
        unmasked_end = (L // BLOCK_N) * BLOCK_N
        masked_end = L
    return unmasked_end, masked_end

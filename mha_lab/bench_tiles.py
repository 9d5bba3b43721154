"""The chunked forward's tile sizes timed side by side, for the ``tiles`` section of ``python -m mha_lab bench``.

``chunked_attention`` walks the scores in tiles of ``block_q`` queries by ``block_k`` keys, one sequence and
key/value head at a time. Small tiles pay Python's loop and small matrix products; large ones leave the core's
cache. ``TILES`` are the candidates measured, the library's default among them (chosen this way, on a 2-core
AMD EPYC); ``tile_calls`` gives each a call of the same forward, plus the default tile with the running maximum
kept for every block (``score_bound=0``): what skipping it where the scores are bounded saves.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import numpy as np

from mha_lab.cpu import MultiHeadAttention, chunked_attention, chunked_forward

__all__ = ["TILES", "RUNNING_MAX", "default_tile", "tile_name", "tile_calls"]

TILES: tuple[tuple[int, int], ...] = ((64, 128), (128, 256), (256, 256), (256, 512), (512, 512), (256, 1024))
"""(block_q, block_k) candidates."""

RUNNING_MAX = ", running max always"
"""The suffix of the default tile's row with ``score_bound=0``."""


def default_tile() -> tuple[int, int]:
    """``chunked_attention``'s default (block_q, block_k)."""
    params = inspect.signature(chunked_attention).parameters
    return params["block_q"].default, params["block_k"].default


def tile_name(tile: tuple[int, int]) -> str:
    """The row name of ``tile`` in the report, marked where it is the default."""
    return f"chunked, tiles {tile[0]} x {tile[1]}" + (" (default)" if tile == default_tile() else "")


def tile_calls(layer: MultiHeadAttention, X: np.ndarray) -> dict[str, Callable[[], np.ndarray]]:
    """``tile_name`` -> the chunked forward of ``layer`` on ``X`` with those tiles; last, the default tile
    with the running maximum always kept (``tile_name`` + ``RUNNING_MAX``)."""
    calls = {tile_name(t): (lambda t=t: chunked_forward(X, layer, block_q=t[0], block_k=t[1])) for t in TILES}
    calls[tile_name(default_tile()) + RUNNING_MAX] = lambda: chunked_forward(X, layer, score_bound=0.0)
    return calls

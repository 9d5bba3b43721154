"""Multi-head attention in PyTorch (CPU or CUDA) and a Triton flash-attention kernel for NVIDIA GPUs.

``MultiHeadAttention`` mirrors the NumPy layer of ``mha_lab.cpu`` (same weight layout) and
picks its attention core by ``backend``. ``flash_attention`` lives in ``mha_lab.cuda.flash``
and is imported on first use, so importing this package never imports Triton and never
asks for a GPU.
"""

from __future__ import annotations

from mha_lab.cuda.attention import BACKENDS, MultiHeadAttention
from mha_lab.cuda.decode import KVCache, decode_step, prefill

__all__ = ["MultiHeadAttention", "BACKENDS", "KVCache", "prefill", "decode_step", "flash_attention"]


def __getattr__(name: str):
    """Import ``flash_attention`` (and with it Triton) only when someone asks for it."""
    if name == "flash_attention":
        from mha_lab.cuda.flash import flash_attention

        return flash_attention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

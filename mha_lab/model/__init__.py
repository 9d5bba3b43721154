"""A small byte-level language model the course trains itself, so that claims about trained models are measured.

``transformer``: the decoder (MHA Lab's own attention layer, RoPE, grouped K/V heads, an optional
learned sink logit); ``corpus``: the text it reads, from a pinned package's source; ``train``: the
committed training command (``python -m mha_lab train``) and the stored weights; ``caches`` and
``evaluate``: the caches servers keep, and what the model does under each (``python -m mha_lab
lm-eval``). Those need PyTorch; this module does not: it reads the stored logs and measurements,
which is all a chapter needs.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["WEIGHTS", "MEASUREMENTS", "training_log", "measurements"]

WEIGHTS = Path(__file__).resolve().parent / "weights"
"""The stored weights (``NAME.npz``, float16) and their training logs (``NAME.json``)."""
MEASUREMENTS = Path(__file__).resolve().parent / "measurements.json"
"""What ``python -m mha_lab lm-eval`` measured on the stored weights."""


def training_log(name: str) -> dict:
    """The training log of the stored model ``name`` (``base``, ``sink-logit``, ``long-pi``, ``gqa-1``, ...)."""
    path = WEIGHTS / f"{name}.json"
    if not path.is_file():
        known = sorted(p.stem for p in WEIGHTS.glob("*.json"))
        raise FileNotFoundError(f"no stored model {name!r}; stored: {known}")
    return json.loads(path.read_text())


def measurements() -> dict:
    """The committed measurements the chapters render."""
    return json.loads(MEASUREMENTS.read_text())

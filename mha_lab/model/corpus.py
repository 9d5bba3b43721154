"""The text the course's model reads: the Python source of Dask, a package pinned in requirements.txt.

Why Dask: its wheel is pure Python (``py3-none-any``), so the pinned version installs the same
bytes on every machine and needs no network once the course's requirements are installed; it
is 5.9 MB of real, varied text (code, docstrings, comments, tests) in 361 files, enough for a
byte-level model of a few hundred thousand weights; and each file is a natural document.

Each file is a document: the start token ``BOS`` followed by its bytes. Files are sorted by
their path inside the package; every tenth (index % 10 == 0) is held out for evaluation.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
from functools import cache
from pathlib import Path

import numpy as np

from mha_lab.model.transformer import BOS

__all__ = ["PACKAGE", "VERSION", "documents", "stream", "digest", "sample_windows", "long_documents"]

PACKAGE = "dask"
VERSION = "2026.8.0"  # as pinned in requirements.txt; another version is another corpus
HOLDOUT_EVERY = 10


def _root() -> Path:
    installed = importlib.metadata.version(PACKAGE)
    if installed != VERSION:
        raise RuntimeError(f"the model's corpus is {PACKAGE}=={VERSION}'s source (requirements.txt), but "
                           f"{PACKAGE}=={installed} is installed: pip install -r requirements.txt")
    return Path(importlib.util.find_spec(PACKAGE).origin).parent


@cache
def _files() -> tuple[tuple[str, bytes], ...]:
    """(path inside the package, bytes) of every .py file, sorted by path."""
    root = _root()
    paths = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py"))
    return tuple((p, (root / p).read_bytes()) for p in paths)


def documents(split: str) -> list[bytes]:
    """The files of ``split``: "train" (9 in 10) or "valid" (every tenth)."""
    if split not in ("train", "valid"):
        raise ValueError(f"split must be 'train' or 'valid', got {split!r}")
    keep = (lambda i: i % HOLDOUT_EVERY == 0) if split == "valid" else (lambda i: i % HOLDOUT_EVERY != 0)
    return [text for i, (_, text) in enumerate(_files()) if keep(i)]


@cache
def stream(split: str) -> np.ndarray:
    """All documents of ``split`` as one token stream, each opened by ``BOS``: (N,) int64."""
    parts = []
    for text in documents(split):
        parts += [np.array([BOS]), np.frombuffer(text, dtype=np.uint8)]
    return np.concatenate(parts).astype(np.int64)


def digest() -> str:
    """SHA-256 of the corpus (every path and its bytes), as recorded in the training log."""
    h = hashlib.sha256()
    for path, text in _files():
        h.update(path.encode() + b"\0" + len(text).to_bytes(8, "little") + text)
    return h.hexdigest()


def sample_windows(tokens: np.ndarray, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """``batch`` training sequences of ``length`` + 1 tokens: ``BOS``, then ``length`` consecutive tokens
    from a random offset of ``tokens`` (so position 0 always holds the start token, as StreamingLLM
    recommends for pretraining). Shapes: -> (batch, length + 1) int64.
    """
    if len(tokens) <= length:
        raise ValueError(f"the stream has {len(tokens)} tokens, too few for windows of {length}")
    starts = rng.integers(0, len(tokens) - length, size=batch)
    rows = np.stack([tokens[s:s + length] for s in starts])  # (batch, length)
    return np.concatenate([np.full((batch, 1), BOS), rows], axis=1)


def long_documents(count: int, length: int) -> np.ndarray:
    """The first ``count`` held-out files at least ``length`` - 1 bytes long, each as ``BOS`` and its
    first ``length`` - 1 bytes: one unbroken document per row, no start token inside.
    Shapes: -> (count, length) int64.
    """
    rows = [np.concatenate([[BOS], np.frombuffer(t[:length - 1], dtype=np.uint8)])
            for t in documents("valid") if len(t) >= length - 1][:count]
    if len(rows) < count:
        raise ValueError(f"only {len(rows)} held-out files have {length - 1} bytes or more, {count} asked for")
    return np.stack(rows).astype(np.int64)

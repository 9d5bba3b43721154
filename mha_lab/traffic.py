r"""Memory traffic of attention: what moves between slow memory (HBM) and fast memory (SRAM).

FlashAttention's argument (Dao et al. 2022, Theorem 2) is about this traffic, not FLOPs. For one
head with sequence length L, head size d_k and a fast memory of ``sram`` elements (the paper's N,
d and M), the standard algorithm writes the L x L scores and probabilities to slow memory and
reads them back, Θ(L d_k + L²) accesses; the tiled algorithm keeps them in fast memory and instead
reads K and V (or Q and O) once per tile of the outer loop, Θ(L² d_k² / sram).

Two views of the same count, which the tests hold equal:

* ``traffic_breakdown`` / ``hbm_traffic``: closed forms, elements per array and bytes in all;
* ``simulate_traffic``: the tiled loops run on real arrays through a ``TwoLevelMemory`` that counts
  every element loaded from and stored to slow memory and refuses a working set larger than sram.

Tiles: the flash loops use square tiles of ``tile_size(d_k, sram)`` rows, the largest b whose working
set (a query tile, its accumulator, a key and a value tile, one b x b score tile and the two
running vectors: 4 b d_k + b² + 2b elements) fits in ``sram``. The standard algorithm is given the same
tiles for its two matrix products, so the only difference left is the L x L matrices.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from mha_lab.analysis import DType, dtype_bytes
from mha_lab.cpu.functional import softmax
from mha_lab.cpu.memory import online_softmax_step

__all__ = ["ALGORITHMS", "tile_size", "traffic_breakdown", "hbm_traffic", "TwoLevelMemory", "TileState",
           "SimulatedTraffic", "simulate_traffic"]

ALGORITHMS = ("standard", "flash1", "flash2")
"""``standard``: S, P and O by three passes through slow memory (the paper's Algorithm 0);
``flash1``: FlashAttention's loop order, key/value tiles outside, query tiles inside (Algorithm 1);
``flash2``: FlashAttention-2's order, query tiles outside, key/value tiles inside (our kernels')."""


def tile_size(d_k: int, sram: int) -> int:
    """The largest tile b (rows) whose flash working set 4 b d_k + b² + 2b fits in ``sram`` elements of fast memory."""
    if d_k < 1:
        raise ValueError(f"head size d_k must be positive, got {d_k}")
    # b² + (4 d_k + 2) b - sram <= 0
    b = int((-(4 * d_k + 2) + math.sqrt((4 * d_k + 2) ** 2 + 4 * sram)) / 2)
    while b > 0 and 4 * b * d_k + b * b + 2 * b > sram:  # guard against rounding in the square root
        b -= 1
    if b < 1:
        raise ValueError(f"fast memory of sram={sram} elements cannot hold one row's working set "
                         f"(4 d_k + 3 = {4 * d_k + 3})")
    return b


def _check(L: int, d_k: int, sram: int, algorithm: str) -> int:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if L < 1:
        raise ValueError(f"sequence length L must be positive, got {L}")
    return tile_size(d_k, sram)


def traffic_breakdown(L: int, d_k: int, sram: int, algorithm: str = "flash2") -> dict[str, dict[str, int]]:
    r"""Elements read from and written to slow memory by one head's forward, per array.

    With tiles of b = ``tile_size(d_k, sram)`` rows and :math:`T = \lceil L / b \rceil` tiles:

    ========= ============================ =============================================
    standard  reads Q, K·T, S, P, V·T       writes S, P, O: :math:`2Ld_k(1 + T) + 4L^2`
              (S twice when L > sram)
    flash1    K, V once; Q, O, m, ℓ T times writes O, m, ℓ T + 1 times: :math:`2Ld_k + T(3Ld_k + 4L) + Ld_k + 2L`
    flash2    Q once; K, V T times          writes O and the log-sum-exp once: :math:`2Ld_k(1 + T) + L`
    ========= ============================ =============================================

    Since :math:`T \approx L/b` and :math:`b \approx \mathrm{sram} / 4d_k` when :math:`\mathrm{sram} \ll 16 d_k^2`,
    the flash terms are :math:`\Theta(L^2 d_k^2 / \mathrm{sram})`; the standard one keeps its :math:`4L^2`.
    Returns ``{"reads": {array: elements}, "writes": {array: elements}}``.
    """
    b = _check(L, d_k, sram, algorithm)
    T = -(-L // b)  # ceil(L / b)
    if algorithm == "standard":
        passes = 1 if L <= sram else 2  # a row longer than fast memory: one pass for max and sum, one to write P
        reads = {"Q": L * d_k, "K": T * L * d_k, "S": passes * L * L, "P": L * L, "V": T * L * d_k}
        writes = {"S": L * L, "P": L * L, "O": L * d_k}
    elif algorithm == "flash1":  # O, m, l start in slow memory (O = 0, l = 0, m = -inf): one write each
        reads = {"K": L * d_k, "V": L * d_k, "Q": T * L * d_k, "O": T * L * d_k, "m": T * L, "l": T * L}
        writes = {"O": (T + 1) * L * d_k, "m": (T + 1) * L, "l": (T + 1) * L}
    else:
        reads = {"Q": L * d_k, "K": T * L * d_k, "V": T * L * d_k}
        writes = {"O": L * d_k, "lse": L}
    return {"reads": reads, "writes": writes}


def hbm_traffic(L: int, d_k: int, sram: int, algorithm: str = "flash2", dtype: DType = "float16") -> int:
    """Bytes moved between slow and fast memory by one head's forward: reads plus writes of
    ``traffic_breakdown``, each element ``dtype``'s size (m, ℓ and the log-sum-exp counted alike)."""
    counts = traffic_breakdown(L, d_k, sram, algorithm)
    return (sum(counts["reads"].values()) + sum(counts["writes"].values())) * dtype_bytes(dtype)


@dataclass
class TwoLevelMemory:
    """Slow memory holding named arrays, and a fast memory of ``sram`` elements; counts every transfer.

    ``load`` copies rows of a slow array into fast memory and ``store`` writes rows back, each
    adding the elements moved to ``reads`` / ``writes`` under the array's name. ``hold`` declares the
    arrays resident in fast memory at one moment and raises if they exceed sram.
    """

    sram: int
    slow: dict[str, np.ndarray] = field(default_factory=dict)
    reads: Counter = field(default_factory=Counter)
    writes: Counter = field(default_factory=Counter)
    peak: int = 0

    def load(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows start:stop of slow array ``name``, copied into fast memory."""
        tile = self.slow[name][start:stop].copy()
        self.reads[name] += tile.size
        return tile

    def store(self, name: str, start: int, value: np.ndarray) -> None:
        """Write ``value`` to rows start:start + len(value) of slow array ``name``."""
        self.slow[name][start:start + len(value)] = value
        self.writes[name] += np.size(value)

    def hold(self, *arrays: np.ndarray) -> None:
        """Check that ``arrays``, resident together, fit in fast memory; track the peak."""
        size = sum(a.size for a in arrays)
        self.peak = max(self.peak, size)
        if size > self.sram:
            raise MemoryError(f"working set of {size} elements exceeds fast memory sram={self.sram}")


@dataclass
class TileState:
    """One query row's running state after each key block: the max m, the normaliser ℓ, the accumulator."""

    m: list[float] = field(default_factory=list)
    l: list[float] = field(default_factory=list)  # noqa: E741 - the paper's ℓ
    acc: list[np.ndarray] = field(default_factory=list)


@dataclass
class SimulatedTraffic:
    """What ``simulate_traffic`` returns: the output, the counted traffic (elements) and the peak working set."""

    out: np.ndarray
    reads: dict[str, int]
    writes: dict[str, int]
    peak: int
    trace: TileState | None = None


def _standard(mem: TwoLevelMemory, L: int, d_k: int, b: int) -> None:
    """Algorithm 0: S = QK^T to slow memory, P = softmax(S) to slow memory, O = PV; products in b-row tiles."""
    scale = 1.0 / math.sqrt(d_k)
    for qs in range(0, L, b):  # S, a block of rows at a time; K streams past in b-row tiles
        q = mem.load("Q", qs, qs + b)
        for ks in range(0, L, b):
            k = mem.load("K", ks, ks + b)
            s = q @ k.T * scale
            mem.hold(q, k, s)
            mem.slow["S"][qs:qs + len(q), ks:ks + len(k)] = s
            mem.writes["S"] += s.size
    for r in range(L):  # the softmax, a row at a time, in chunks of at most sram scores
        if L <= mem.sram:
            row = mem.load("S", r, r + 1)
            mem.hold(row)
            mem.store("P", r, softmax(row))
            continue
        m, total = -np.inf, 0.0  # pass 1: the row's max and normaliser, online
        for c in range(0, L, mem.sram):
            chunk = mem.slow["S"][r, c:c + mem.sram].copy()
            mem.reads["S"] += chunk.size
            m_new = max(m, chunk.max())
            total = total * math.exp(m - m_new) + np.exp(chunk - m_new).sum()
            m = m_new
        for c in range(0, L, mem.sram):  # pass 2: read again, write the probabilities
            chunk = mem.slow["S"][r, c:c + mem.sram].copy()
            mem.reads["S"] += chunk.size
            mem.hold(chunk)
            mem.slow["P"][r, c:c + mem.sram] = np.exp(chunk - m) / total
            mem.writes["P"] += chunk.size
    for qs in range(0, L, b):  # O = P V, a block of rows at a time; V streams past
        acc = np.zeros((min(b, L - qs), d_k))
        for ks in range(0, L, b):
            p = mem.slow["P"][qs:qs + b, ks:ks + b].copy()
            mem.reads["P"] += p.size
            v = mem.load("V", ks, ks + b)
            mem.hold(acc, p, v)
            acc += p @ v
        mem.store("O", qs, acc)


def _flash1(mem: TwoLevelMemory, L: int, d_k: int, b: int) -> None:
    """Algorithm 1 of FlashAttention: each K/V tile loaded once; Q, O, m, ℓ reloaded for every K/V tile."""
    mem.store("O", 0, np.zeros((L, d_k)))
    mem.store("m", 0, np.full((L, 1), -np.inf))
    mem.store("l", 0, np.zeros((L, 1)))
    scale = 1.0 / math.sqrt(d_k)
    for ks in range(0, L, b):
        k, v = mem.load("K", ks, ks + b), mem.load("V", ks, ks + b)
        for qs in range(0, L, b):
            q, o = mem.load("Q", qs, qs + b), mem.load("O", qs, qs + b)
            m_i, l_i = mem.load("m", qs, qs + b), mem.load("l", qs, qs + b)
            s = q @ k.T * scale
            mem.hold(q, o, k, v, s, m_i, l_i)
            m_i, l_i, acc = online_softmax_step(m_i, l_i, o * l_i, s, v)  # O is kept normalised: acc = O ℓ
            mem.store("O", qs, acc / l_i)
            mem.store("m", qs, m_i)
            mem.store("l", qs, l_i)


def _flash2(mem: TwoLevelMemory, L: int, d_k: int, b: int, trace: TileState) -> None:
    """FlashAttention-2's order (``chunked_attention``'s and the Triton kernel's): each Q tile loaded once,
    K and V streamed past it, O normalised once at the end. Records row 0's state in ``trace``."""
    scale = 1.0 / math.sqrt(d_k)
    for qs in range(0, L, b):
        q = mem.load("Q", qs, qs + b)
        m_i, l_i, acc = np.full((len(q), 1), -np.inf), np.zeros((len(q), 1)), np.zeros((len(q), d_k))
        for ks in range(0, L, b):
            k, v = mem.load("K", ks, ks + b), mem.load("V", ks, ks + b)
            s = q @ k.T * scale
            mem.hold(q, acc, k, v, s, m_i, l_i)
            m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v)
            if qs == 0:
                trace.m.append(float(m_i[0, 0]))
                trace.l.append(float(l_i[0, 0]))
                trace.acc.append(acc[0].copy())
        mem.store("O", qs, acc / l_i)
        mem.store("lse", qs, m_i + np.log(l_i))


def simulate_traffic(Q: np.ndarray, K: np.ndarray, V: np.ndarray, sram: int,
                     algorithm: str = "flash2") -> SimulatedTraffic:
    r"""Run one head's attention with Q, K, V in slow memory and a fast memory of sram elements; count transfers.

    .. math:: O = \mathrm{softmax}(QK^\top / \sqrt{d_k})\, V

    Shapes: Q, K, V (L, d_k) -> out (L, d_k). Tiles of ``tile_size(d_k, sram)`` rows. The counts are
    elements, per array; ``trace`` (flash2 only) holds query row 0's m, ℓ and acc after each key tile.
    """
    for name, t in (("Q", Q), ("K", K), ("V", V)):
        if not isinstance(t, np.ndarray) or t.ndim != 2:
            raise ValueError(f"{name} must be a 2-D array (L, d_k), got {getattr(t, 'shape', type(t).__name__)}")
    if not Q.shape == K.shape == V.shape:
        raise ValueError(f"Q, K, V must have one shape (L, d_k), got {Q.shape}, {K.shape}, {V.shape}")
    L, d_k = Q.shape
    b = _check(L, d_k, sram, algorithm)
    mem = TwoLevelMemory(sram, {"Q": Q, "K": K, "V": V, "O": np.empty((L, d_k))})
    trace = None
    if algorithm == "standard":
        mem.slow.update(S=np.empty((L, L)), P=np.empty((L, L)))
        _standard(mem, L, d_k, b)
    elif algorithm == "flash1":
        mem.slow.update(m=np.empty((L, 1)), l=np.empty((L, 1)))
        _flash1(mem, L, d_k, b)
    else:
        mem.slow["lse"] = np.empty((L, 1))
        trace = TileState()
        _flash2(mem, L, d_k, b, trace)
    return SimulatedTraffic(mem.slow["O"], dict(mem.reads), dict(mem.writes), mem.peak, trace)

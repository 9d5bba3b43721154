r"""Memory traffic of attention: what moves between slow memory (HBM) and fast memory (SRAM).

FlashAttention's argument (Dao et al. 2022, Theorem 2) is about this traffic, not FLOPs. For one
head with sequence length N, head size d and a fast memory of M elements, the standard algorithm
writes the N x N scores and probabilities to slow memory and reads them back, Θ(Nd + N²)
accesses; the tiled algorithm keeps them in fast memory and instead reads K and V (or Q and O)
once per tile of the outer loop, Θ(N²d²/M).

Two views of the same count, which the tests hold equal:

* ``traffic_breakdown`` / ``hbm_traffic``: closed forms, elements per array and bytes in all;
* ``simulate_traffic``: the tiled loops run on real arrays through a ``TwoLevelMemory`` that counts
  every element loaded from and stored to slow memory and refuses a working set larger than M.

Tiles: the flash loops use square tiles of ``tile_size(d, M)`` rows, the largest b whose working
set (a query tile, its accumulator, a key and a value tile, one b x b score tile and the two
running vectors: 4bd + b² + 2b elements) fits in M. The standard algorithm is given the same
tiles for its two matrix products, so the only difference left is the N x N matrices.
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


def tile_size(d: int, M: int) -> int:
    """The largest tile b (rows) whose flash working set 4bd + b² + 2b fits in M elements of fast memory."""
    if d < 1:
        raise ValueError(f"head size d must be positive, got {d}")
    # b² + (4d + 2) b - M <= 0
    b = int((-(4 * d + 2) + math.sqrt((4 * d + 2) ** 2 + 4 * M)) / 2)
    while b > 0 and 4 * b * d + b * b + 2 * b > M:  # guard against rounding in the square root
        b -= 1
    if b < 1:
        raise ValueError(f"fast memory of M={M} elements cannot hold one row's working set (4d + 3 = {4 * d + 3})")
    return b


def _check(N: int, d: int, M: int, algorithm: str) -> int:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if N < 1:
        raise ValueError(f"sequence length N must be positive, got {N}")
    return tile_size(d, M)


def traffic_breakdown(N: int, d: int, M: int, algorithm: str = "flash2") -> dict[str, dict[str, int]]:
    r"""Elements read from and written to slow memory by one head's forward, per array.

    With tiles of b = ``tile_size(d, M)`` rows and :math:`T = \lceil N / b \rceil` tiles:

    ========= ============================ =============================================
    standard  reads Q, K·T, S, P, V·T       writes S, P, O: :math:`2Nd(1 + T) + 4N^2`
              (S twice when N > M)
    flash1    K, V once; Q, O, m, ℓ T times writes O, m, ℓ T + 1 times: :math:`2Nd + T(3Nd + 4N) + Nd + 2N`
    flash2    Q once; K, V T times          writes O and the log-sum-exp once: :math:`2Nd(1 + T) + N`
    ========= ============================ =============================================

    Since :math:`T \approx N/b` and :math:`b \approx M / 4d` when :math:`M \ll 16 d^2`, the flash
    terms are :math:`\Theta(N^2 d^2 / M)`; the standard one keeps its :math:`4N^2`.
    Returns ``{"reads": {array: elements}, "writes": {array: elements}}``.
    """
    b = _check(N, d, M, algorithm)
    T = -(-N // b)  # ceil(N / b)
    if algorithm == "standard":
        passes = 1 if N <= M else 2  # a row longer than fast memory: one pass for max and sum, one to write P
        reads = {"Q": N * d, "K": T * N * d, "S": passes * N * N, "P": N * N, "V": T * N * d}
        writes = {"S": N * N, "P": N * N, "O": N * d}
    elif algorithm == "flash1":  # O, m, l start in slow memory (O = 0, l = 0, m = -inf): one write each
        reads = {"K": N * d, "V": N * d, "Q": T * N * d, "O": T * N * d, "m": T * N, "l": T * N}
        writes = {"O": (T + 1) * N * d, "m": (T + 1) * N, "l": (T + 1) * N}
    else:
        reads = {"Q": N * d, "K": T * N * d, "V": T * N * d}
        writes = {"O": N * d, "lse": N}
    return {"reads": reads, "writes": writes}


def hbm_traffic(N: int, d: int, M: int, algorithm: str = "flash2", dtype: DType = "float16") -> int:
    """Bytes moved between slow and fast memory by one head's forward: reads plus writes of
    ``traffic_breakdown``, each element ``dtype``'s size (m, ℓ and the log-sum-exp counted alike)."""
    counts = traffic_breakdown(N, d, M, algorithm)
    return (sum(counts["reads"].values()) + sum(counts["writes"].values())) * dtype_bytes(dtype)


@dataclass
class TwoLevelMemory:
    """Slow memory holding named arrays, and a fast memory of ``M`` elements; counts every transfer.

    ``load`` copies rows of a slow array into fast memory and ``store`` writes rows back, each
    adding the elements moved to ``reads`` / ``writes`` under the array's name. ``hold`` declares the
    arrays resident in fast memory at one moment and raises if they exceed M.
    """

    M: int
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
        if size > self.M:
            raise MemoryError(f"working set of {size} elements exceeds fast memory M={self.M}")


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


def _standard(mem: TwoLevelMemory, N: int, d: int, b: int) -> None:
    """Algorithm 0: S = QK^T to slow memory, P = softmax(S) to slow memory, O = PV; products in b-row tiles."""
    scale = 1.0 / math.sqrt(d)
    for qs in range(0, N, b):  # S, a block of rows at a time; K streams past in b-row tiles
        q = mem.load("Q", qs, qs + b)
        for ks in range(0, N, b):
            k = mem.load("K", ks, ks + b)
            s = q @ k.T * scale
            mem.hold(q, k, s)
            mem.slow["S"][qs:qs + len(q), ks:ks + len(k)] = s
            mem.writes["S"] += s.size
    for r in range(N):  # the softmax, a row at a time, in chunks of at most M scores
        if N <= mem.M:
            row = mem.load("S", r, r + 1)
            mem.hold(row)
            mem.store("P", r, softmax(row))
            continue
        m, total = -np.inf, 0.0  # pass 1: the row's max and normaliser, online
        for c in range(0, N, mem.M):
            chunk = mem.slow["S"][r, c:c + mem.M].copy()
            mem.reads["S"] += chunk.size
            m_new = max(m, chunk.max())
            total = total * math.exp(m - m_new) + np.exp(chunk - m_new).sum()
            m = m_new
        for c in range(0, N, mem.M):  # pass 2: read again, write the probabilities
            chunk = mem.slow["S"][r, c:c + mem.M].copy()
            mem.reads["S"] += chunk.size
            mem.hold(chunk)
            mem.slow["P"][r, c:c + mem.M] = np.exp(chunk - m) / total
            mem.writes["P"] += chunk.size
    for qs in range(0, N, b):  # O = P V, a block of rows at a time; V streams past
        acc = np.zeros((min(b, N - qs), d))
        for ks in range(0, N, b):
            p = mem.slow["P"][qs:qs + b, ks:ks + b].copy()
            mem.reads["P"] += p.size
            v = mem.load("V", ks, ks + b)
            mem.hold(acc, p, v)
            acc += p @ v
        mem.store("O", qs, acc)


def _flash1(mem: TwoLevelMemory, N: int, d: int, b: int) -> None:
    """Algorithm 1 of FlashAttention: each K/V tile loaded once; Q, O, m, ℓ reloaded for every K/V tile."""
    mem.store("O", 0, np.zeros((N, d)))
    mem.store("m", 0, np.full((N, 1), -np.inf))
    mem.store("l", 0, np.zeros((N, 1)))
    scale = 1.0 / math.sqrt(d)
    for ks in range(0, N, b):
        k, v = mem.load("K", ks, ks + b), mem.load("V", ks, ks + b)
        for qs in range(0, N, b):
            q, o = mem.load("Q", qs, qs + b), mem.load("O", qs, qs + b)
            m_i, l_i = mem.load("m", qs, qs + b), mem.load("l", qs, qs + b)
            s = q @ k.T * scale
            mem.hold(q, o, k, v, s, m_i, l_i)
            m_i, l_i, acc = online_softmax_step(m_i, l_i, o * l_i, s, v)  # O is kept normalised: acc = O ℓ
            mem.store("O", qs, acc / l_i)
            mem.store("m", qs, m_i)
            mem.store("l", qs, l_i)


def _flash2(mem: TwoLevelMemory, N: int, d: int, b: int, trace: TileState) -> None:
    """FlashAttention-2's order (``chunked_attention``'s and the Triton kernel's): each Q tile loaded once,
    K and V streamed past it, O normalised once at the end. Records row 0's state in ``trace``."""
    scale = 1.0 / math.sqrt(d)
    for qs in range(0, N, b):
        q = mem.load("Q", qs, qs + b)
        m_i, l_i, acc = np.full((len(q), 1), -np.inf), np.zeros((len(q), 1)), np.zeros((len(q), d))
        for ks in range(0, N, b):
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


def simulate_traffic(Q: np.ndarray, K: np.ndarray, V: np.ndarray, M: int,
                     algorithm: str = "flash2") -> SimulatedTraffic:
    r"""Run one head's attention with Q, K, V in slow memory and a fast memory of M elements; count transfers.

    .. math:: O = \mathrm{softmax}(QK^\top / \sqrt{d})\, V

    Shapes: Q, K, V (N, d) -> out (N, d). Tiles of ``tile_size(d, M)`` rows. The counts are
    elements, per array; ``trace`` (flash2 only) holds query row 0's m, ℓ and acc after each key tile.
    """
    for name, t in (("Q", Q), ("K", K), ("V", V)):
        if not isinstance(t, np.ndarray) or t.ndim != 2:
            raise ValueError(f"{name} must be a 2-D array (N, d), got {getattr(t, 'shape', type(t).__name__)}")
    if not Q.shape == K.shape == V.shape:
        raise ValueError(f"Q, K, V must have one shape (N, d), got {Q.shape}, {K.shape}, {V.shape}")
    N, d = Q.shape
    b = _check(N, d, M, algorithm)
    mem = TwoLevelMemory(M, {"Q": Q, "K": K, "V": V, "O": np.empty((N, d))})
    trace = None
    if algorithm == "standard":
        mem.slow.update(S=np.empty((N, N)), P=np.empty((N, N)))
        _standard(mem, N, d, b)
    elif algorithm == "flash1":
        mem.slow.update(m=np.empty((N, 1)), l=np.empty((N, 1)))
        _flash1(mem, N, d, b)
    else:
        mem.slow["lse"] = np.empty((N, 1))
        trace = TileState()
        _flash2(mem, N, d, b, trace)
    return SimulatedTraffic(mem.slow["O"], dict(mem.reads), dict(mem.writes), mem.peak, trace)

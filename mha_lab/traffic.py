r"""Memory traffic of attention: what moves between slow memory (HBM) and fast memory (SRAM).

FlashAttention's argument (Dao et al. 2022, Theorem 2) is about this traffic, not FLOPs. For one
head with sequence length L, head size d_k and a fast memory of ``sram`` elements (the paper's N,
d and M), the standard algorithm writes the L x L scores and probabilities to slow memory and
reads them back, Θ(L d_k + L²) accesses; the tiled algorithm keeps them in fast memory and instead
re-reads whatever its inner loop streams once per block of the outer loop, Θ(L² d_k² / sram): in
the paper's Algorithm 1 the outer loop runs over K/V blocks and Q, O, m and ℓ are re-read.

Two views of the same count, which the tests hold equal:

* ``traffic_breakdown`` / ``hbm_traffic``: closed forms, elements per array and bytes in all;
* ``simulate_traffic``: the tiled loops run on real arrays through a ``TwoLevelMemory`` that counts
  every element loaded from and stored to slow memory and refuses a working set larger than sram.

Tiles (``TILINGS``): every loop has an outer block of rows and an inner block (``tile_shape``).

* ``paper``: Algorithm 1's B_c = ⌈M / 4d⌉ rows for the outer block and B_r = min(⌈M / 4d⌉, d) for the
  inner one, so each of Q_i, O_i, K_j, V_j and the score tile S_ij holds at most about M / 4 elements.
  Together (with m and ℓ) they need 2(B_c + B_r) d + B_r B_c + 2 B_r elements, which exceeds M when M is
  below about 8 d²: the theorem's Θ absorbs that constant, and the simulation gives such tiles the fast
  memory they need (``SimulatedTraffic.peak`` says how much). FlashAttention-2's loop (queries outside) and
  the standard algorithm's products use the same rule, the outer block being the query block.
* ``square``: b x b tiles, b = ``tile_size(d_k, sram)``, the largest whose working set 4 b d_k + b² + 2b
  fits in ``sram``; the score tile can then take most of fast memory.

The standard algorithm is given the same tiles for its two matrix products, so it too re-reads K and V
once per query block; only the L x L matrices are its own.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from mha_lab.analysis import DType, dtype_bytes
from mha_lab.cpu.functional import softmax
from mha_lab.cpu.memory import online_softmax_step

__all__ = ["ALGORITHMS", "TILINGS", "tile_size", "tile_shape", "working_set", "traffic_breakdown", "hbm_traffic",
           "TwoLevelMemory", "TileState", "SimulatedTraffic", "simulate_traffic"]

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


TILINGS = ("paper", "square")
"""``paper``: FlashAttention's B_c = ⌈M/4d⌉, B_r = min(⌈M/4d⌉, d); ``square``: b x b tiles filling fast memory."""


def tile_shape(d_k: int, sram: int, tiling: str = "paper") -> tuple[int, int]:
    """Rows of the outer loop's block and of the inner loop's block: (⌈M/4d⌉, min(⌈M/4d⌉, d)) for the paper's
    tiles, (b, b) with b = ``tile_size(d_k, sram)`` for square ones."""
    if tiling not in TILINGS:
        raise ValueError(f"tiling must be one of {TILINGS}, got {tiling!r}")
    if tiling == "square":
        b = tile_size(d_k, sram)
        return b, b
    if d_k < 1 or sram < d_k:
        raise ValueError(f"the paper's tiles need d_k >= 1 and sram >= d_k, got d_k={d_k}, sram={sram}")
    outer = -(-sram // (4 * d_k))  # ceil(M / 4d)
    return outer, min(outer, d_k)


def working_set(d_k: int, outer: int, inner: int, algorithm: str) -> int:
    """Elements resident in fast memory at once in the loops of ``algorithm`` with these blocks. A flash loop
    holds two blocks of outer rows and two of inner rows (d_k wide), their score tile and the running m and ℓ
    of its query block; the standard products one block of each, and the score or probability tile."""
    if algorithm == "standard":
        return (outer + inner) * d_k + outer * inner
    return 2 * (outer + inner) * d_k + outer * inner + 2 * (inner if algorithm == "flash1" else outer)


def _check(L: int, d_k: int, sram: int, algorithm: str, tiling: str) -> int:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if L < 1:
        raise ValueError(f"sequence length L must be positive, got {L}")
    return tile_shape(d_k, sram, tiling)


def traffic_breakdown(L: int, d_k: int, sram: int, algorithm: str = "flash2",
                      tiling: str = "paper") -> dict[str, dict[str, int]]:
    r"""Elements read from and written to slow memory by one head's forward, per array.

    With an outer block of :math:`b` rows (``tile_shape``) and :math:`T = \lceil L / b \rceil` outer blocks
    (key/value blocks for flash1, query blocks otherwise):

    ========= ============================ =============================================
    standard  reads Q, K·T, S, P, V·T       writes S, P, O: :math:`2Ld_k(1 + T) + 4L^2`
              (S twice when L > sram)
    flash1    K, V once; Q, O, m, ℓ T times writes O, m, ℓ T + 1 times: :math:`2Ld_k + T(3Ld_k + 4L) + Ld_k + 2L`
    flash2    Q once; K, V T times          writes O and the log-sum-exp once: :math:`2Ld_k(1 + T) + L`
    ========= ============================ =============================================

    With the paper's tiles :math:`T \approx 4Ld_k/\mathrm{sram}`, so flash1 moves about
    :math:`12 L^2 d_k^2 / \mathrm{sram}` and flash2 about :math:`8 L^2 d_k^2 / \mathrm{sram}`. The standard
    count is not only :math:`4L^2`: its tiled products re-read K and V too, :math:`2Ld_kT`.
    Returns ``{"reads": {array: elements}, "writes": {array: elements}}``.
    """
    b, _ = _check(L, d_k, sram, algorithm, tiling)
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


def hbm_traffic(L: int, d_k: int, sram: int, algorithm: str = "flash2", dtype: DType = "float16",
                tiling: str = "paper") -> int:
    """Bytes moved between slow and fast memory by one head's forward: reads plus writes of
    ``traffic_breakdown``, each element ``dtype``'s size (m, ℓ and the log-sum-exp counted alike)."""
    counts = traffic_breakdown(L, d_k, sram, algorithm, tiling)
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


def _standard(mem: TwoLevelMemory, L: int, d_k: int, b: int, c: int, sram: int) -> None:
    """Algorithm 0: S = QK^T to slow memory, P = softmax(S) to slow memory, O = PV; products in blocks of b
    query rows and c key rows; the softmax reads a row in chunks of at most ``sram`` scores."""
    scale = 1.0 / math.sqrt(d_k)
    for qs in range(0, L, b):  # S, a block of rows at a time; K streams past in c-row tiles
        q = mem.load("Q", qs, qs + b)
        for ks in range(0, L, c):
            k = mem.load("K", ks, ks + c)
            s = q @ k.T * scale
            mem.hold(q, k, s)
            mem.slow["S"][qs:qs + len(q), ks:ks + len(k)] = s
            mem.writes["S"] += s.size
    for r in range(L):  # the softmax, a row at a time, in chunks of at most sram scores
        if L <= sram:
            row = mem.load("S", r, r + 1)
            mem.hold(row)
            mem.store("P", r, softmax(row))
            continue
        m, total = -np.inf, 0.0  # pass 1: the row's max and normaliser, online
        for j in range(0, L, sram):
            chunk = mem.slow["S"][r, j:j + sram].copy()
            mem.reads["S"] += chunk.size
            m_new = max(m, chunk.max())
            total = total * math.exp(m - m_new) + np.exp(chunk - m_new).sum()
            m = m_new
        for j in range(0, L, sram):  # pass 2: read again, write the probabilities
            chunk = mem.slow["S"][r, j:j + sram].copy()
            mem.reads["S"] += chunk.size
            mem.hold(chunk)
            mem.slow["P"][r, j:j + sram] = np.exp(chunk - m) / total
            mem.writes["P"] += chunk.size
    for qs in range(0, L, b):  # O = P V, a block of rows at a time; V streams past
        acc = np.zeros((min(b, L - qs), d_k))
        for ks in range(0, L, c):
            p = mem.slow["P"][qs:qs + b, ks:ks + c].copy()
            mem.reads["P"] += p.size
            v = mem.load("V", ks, ks + c)
            mem.hold(acc, p, v)
            acc += p @ v
        mem.store("O", qs, acc)


def _flash1(mem: TwoLevelMemory, L: int, d_k: int, b: int, c: int) -> None:
    """Algorithm 1 of FlashAttention: each K/V block (b rows) loaded once; Q, O, m, ℓ reloaded, c rows at a
    time, for every K/V block."""
    mem.store("O", 0, np.zeros((L, d_k)))
    mem.store("m", 0, np.full((L, 1), -np.inf))
    mem.store("l", 0, np.zeros((L, 1)))
    scale = 1.0 / math.sqrt(d_k)
    for ks in range(0, L, b):
        k, v = mem.load("K", ks, ks + b), mem.load("V", ks, ks + b)
        for qs in range(0, L, c):
            q, o = mem.load("Q", qs, qs + c), mem.load("O", qs, qs + c)
            m_i, l_i = mem.load("m", qs, qs + c), mem.load("l", qs, qs + c)
            s = q @ k.T * scale
            mem.hold(q, o, k, v, s, m_i, l_i)
            m_i, l_i, acc = online_softmax_step(m_i, l_i, o * l_i, s, v)  # O is kept normalised: acc = O ℓ
            mem.store("O", qs, acc / l_i)
            mem.store("m", qs, m_i)
            mem.store("l", qs, l_i)


def _flash2(mem: TwoLevelMemory, L: int, d_k: int, b: int, c: int, trace: TileState) -> None:
    """FlashAttention-2's order (``chunked_attention``'s and the Triton kernel's): each Q block (b rows) loaded
    once, K and V streamed past it c rows at a time, O normalised once at the end. Records row 0's state in
    ``trace``."""
    scale = 1.0 / math.sqrt(d_k)
    for qs in range(0, L, b):
        q = mem.load("Q", qs, qs + b)
        m_i, l_i, acc = np.full((len(q), 1), -np.inf), np.zeros((len(q), 1)), np.zeros((len(q), d_k))
        for ks in range(0, L, c):
            k, v = mem.load("K", ks, ks + c), mem.load("V", ks, ks + c)
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
                     algorithm: str = "flash2", tiling: str = "paper") -> SimulatedTraffic:
    r"""Run one head's attention with Q, K, V in slow memory and a fast memory of sram elements; count transfers.

    .. math:: O = \mathrm{softmax}(QK^\top / \sqrt{d_k})\, V

    Shapes: Q, K, V (L, d_k) -> out (L, d_k). Blocks of ``tile_shape(d_k, sram, tiling)`` rows. The counts
    are elements, per array; ``trace`` (flash2 only) holds query row 0's m, ℓ and acc after each key tile.
    Square tiles must fit ``sram``; the paper's are given ``max(sram, working_set)`` (see the module).
    """
    for name, t in (("Q", Q), ("K", K), ("V", V)):
        if not isinstance(t, np.ndarray) or t.ndim != 2:
            raise ValueError(f"{name} must be a 2-D array (L, d_k), got {getattr(t, 'shape', type(t).__name__)}")
    if not Q.shape == K.shape == V.shape:
        raise ValueError(f"Q, K, V must have one shape (L, d_k), got {Q.shape}, {K.shape}, {V.shape}")
    L, d_k = Q.shape
    b, c = _check(L, d_k, sram, algorithm, tiling)
    capacity = sram if tiling == "square" else max(sram, working_set(d_k, b, c, algorithm))
    mem = TwoLevelMemory(capacity, {"Q": Q, "K": K, "V": V, "O": np.empty((L, d_k))})
    trace = None
    if algorithm == "standard":
        mem.slow.update(S=np.empty((L, L)), P=np.empty((L, L)))
        _standard(mem, L, d_k, b, c, sram)
    elif algorithm == "flash1":
        mem.slow.update(m=np.empty((L, 1)), l=np.empty((L, 1)))
        _flash1(mem, L, d_k, b, c)
    else:
        mem.slow["lse"] = np.empty((L, 1))
        trace = TileState()
        _flash2(mem, L, d_k, b, c, trace)
    return SimulatedTraffic(mem.slow["O"], dict(mem.reads), dict(mem.writes), mem.peak, trace)

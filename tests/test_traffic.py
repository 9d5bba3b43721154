"""Memory traffic: the closed forms against the simulated tiled loops, and FlashAttention's Theorem 2."""

import numpy as np
import pytest

from mha_lab.analysis import dtype_bytes
from mha_lab.cpu import scaled_dot_product_attention
from mha_lab.testing import assert_close
from mha_lab.traffic import (
    ALGORITHMS,
    TILINGS,
    hbm_traffic,
    simulate_traffic,
    tile_shape,
    tile_size,
    traffic_breakdown,
    working_set,
)


@pytest.mark.parametrize("L, d_k, sram", [(97, 16, 2000), (1, 8, 600), (64, 8, 600), (40, 4, 10_000), (300, 4, 120),
                                          (200, 8, 4000)])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("tiling", TILINGS)
def test_simulated_loads_and_stores_equal_the_closed_form(L, d_k, sram, algorithm, tiling):
    Q, K, V = np.random.default_rng(L + d_k).standard_normal((3, L, d_k))
    sim = simulate_traffic(Q, K, V, sram, algorithm, tiling)
    expected = traffic_breakdown(L, d_k, sram, algorithm, tiling)
    assert sim.reads == expected["reads"]
    assert sim.writes == expected["writes"]
    outer, inner = tile_shape(d_k, sram, tiling)
    assert sim.peak <= (sram if tiling == "square" else max(sram, working_set(d_k, outer, inner, algorithm)))
    assert_close(sim.out, scaled_dot_product_attention(Q, K, V)[0])
    total = sum(sim.reads.values()) + sum(sim.writes.values())
    assert hbm_traffic(L, d_k, sram, algorithm, "float32", tiling) == 4 * total


def test_the_papers_tiles_are_algorithm_1s_and_keep_the_score_tile_within_a_quarter_of_m():
    assert tile_shape(64, 2**16) == (256, 64)  # B_c = ceil(65536 / 256), B_r = min(B_c, d)
    assert tile_shape(64, 2**13) == (32, 32) and tile_shape(64, 1000) == (4, 4)
    for d, M in ((64, 2**16), (128, 2**16), (16, 3000), (64, 5000)):
        b_c, b_r = tile_shape(d, M)
        assert b_c == -(-M // (4 * d)) and b_r == min(b_c, d)
        assert b_r * b_c <= M / 4 + d  # ceil's one extra row
    # the paper's tiles fit M at the book's sizes; below about 8 d² they overfill it (the theorem's constant)
    assert working_set(64, 256, 64, "flash1") == 2 * 320 * 64 + 256 * 64 + 2 * 64 == 57_472 <= 2**16
    assert working_set(64, 32, 32, "flash1") == 9_280 > 2**13
    with pytest.raises(ValueError, match="tiling"):
        tile_shape(64, 2**16, "round")


def test_flashattention_1_with_the_papers_tiles_at_the_books_sizes():
    """N = 8192, d = 64, M = 65,536: B_c = 256, B_r = 64, T_c = 32 K/V blocks. Algorithm 1 reads K and V once
    (2Nd), and per K/V block reads Q, O, m, ℓ and writes O, m, ℓ (3Nd + 4N); O, m, ℓ are initialised once."""
    N, d, M = 8192, 64, 2**16
    parts = traffic_breakdown(N, d, M, "flash1")
    total = sum(parts["reads"].values()) + sum(parts["writes"].values())
    assert total == 2 * N * d + 32 * (3 * N * d + 4 * N) + N * d + 2 * N == 52_969_472
    assert parts["reads"]["K"] == parts["reads"]["V"] == N * d  # K and V once: the re-read arrays are Q, O, m, ℓ
    # Theorem 2's bound up to its stated constant: 12 N² d² / M from Q, O read and O written per K/V block
    leading = 12 * N**2 * d**2 / M
    assert leading < total < 1.06 * leading
    for n in (2**14, 2**16):  # the constant holds as N grows: the ratio tends to 1 + 4/(3d) + ...
        p = traffic_breakdown(n, d, M, "flash1")
        assert 1 < (sum(p["reads"].values()) + sum(p["writes"].values())) / (12 * n**2 * d**2 / M) < 1.06
    # less than FlashAttention-2 with square tiles of 157 rows (T = 53), more than with the paper's rule
    assert tile_size(d, M) == 157
    assert hbm_traffic(N, d, M, "flash2", tiling="square") // 2 == 2 * N * d * 54 + N == 56_631_296
    assert hbm_traffic(N, d, M, "flash2") // 2 == 2 * N * d * 33 + N < 52_969_472


def test_the_standard_count_includes_the_re_reads_of_its_tiled_products():
    """2 L d_k (1 + T) + 4 L²: at M = 8,192 (square tiles, L = 1024, d = 64) S and P are under half of it."""
    L, d, M = 1024, 64, 2**13
    for tiling in TILINGS:
        T = -(-L // tile_shape(d, M, tiling)[0])
        parts = traffic_breakdown(L, d, M, "standard", tiling)
        total = sum(parts["reads"].values()) + sum(parts["writes"].values())
        assert total == 2 * L * d * (1 + T) + 4 * L * L
    sp = 4 * L * L / (2 * L * d * (1 + -(-L // tile_size(d, M))) + 4 * L * L)
    assert round(sp, 2) == 0.46


def test_tile_size_is_the_largest_that_fits():
    for d, M in ((16, 2000), (64, 100_000), (128, 50_000), (1, 7)):
        b = tile_size(d, M)
        assert 4 * b * d + b * b + 2 * b <= M < 4 * (b + 1) * d + (b + 1) ** 2 + 2 * (b + 1)
    with pytest.raises(ValueError, match="cannot hold one row"):
        tile_size(64, 200)


def test_theorem_2_flash_traffic_falls_with_m_and_standard_keeps_n_squared():
    N, d = 8192, 64
    Ms = [2**14, 2**15, 2**16, 2**17]  # 32 KiB to 256 KiB of fp16
    flash = [hbm_traffic(N, d, M, "flash2") for M in Ms]
    standard = [hbm_traffic(N, d, M, "standard") for M in Ms]
    # Θ(N² d² / M): with the paper's tiles doubling M halves the traffic, to within its Θ(N d) terms
    for small, large in zip(flash, flash[1:], strict=False):
        assert 0.5 < large / small < 0.56
    # square tiles fall more slowly once the b² score tile takes its share of fast memory
    square = [hbm_traffic(N, d, M, "flash2", tiling="square") for M in Ms]
    assert square[-1] / square[-2] > 0.6
    # the standard algorithm's 4N² of S and P stays whatever M is
    assert all(s > 4 * N * N * dtype_bytes("float16") for s in standard)
    assert standard[-1] / flash[-1] > 8 and standard[-2] / flash[-2] > 5
    # FlashAttention-2's loop order reads less than FlashAttention's: Q and O are not reloaded
    assert all(hbm_traffic(N, d, M, "flash2") < hbm_traffic(N, d, M, "flash1") for M in Ms)


def test_trace_of_one_row_ends_at_its_output():
    Q, K, V = np.random.default_rng(1).standard_normal((3, 50, 4))
    sim = simulate_traffic(Q, K, V, sram=200, algorithm="flash2")
    b = tile_shape(4, 200)[1]  # keys per tile: the inner block
    trace = sim.trace
    assert len(trace.m) == -(-50 // b) > 1
    assert np.all(np.diff(trace.m) >= 0)  # the running maximum never falls
    assert_close(trace.acc[-1] / trace.l[-1], sim.out[0])
    scores = Q[0] @ K.T / 2.0
    assert trace.m[-1] == pytest.approx(scores.max())
    assert trace.l[-1] == pytest.approx(np.exp(scores - scores.max()).sum())


def test_bad_input_is_rejected():
    Q = np.zeros((8, 4))
    with pytest.raises(ValueError, match="algorithm must be one of"):
        simulate_traffic(Q, Q, Q, 500, "flash3")
    with pytest.raises(ValueError, match="one shape"):
        simulate_traffic(Q, np.zeros((9, 4)), Q, 500)
    with pytest.raises(ValueError, match="2-D array"):
        simulate_traffic(Q[None], Q, Q, 500)
    with pytest.raises(ValueError, match="sequence length L must be positive"):
        traffic_breakdown(0, 4, 2000, "standard")

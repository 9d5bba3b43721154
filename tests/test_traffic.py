"""Memory traffic: the closed forms against the simulated tiled loops, and FlashAttention's Theorem 2."""

import numpy as np
import pytest

from mha_lab.analysis import dtype_bytes
from mha_lab.cpu import scaled_dot_product_attention
from mha_lab.testing import assert_close
from mha_lab.traffic import ALGORITHMS, hbm_traffic, simulate_traffic, tile_size, traffic_breakdown


@pytest.mark.parametrize("L, d_k, sram", [(97, 16, 2000), (1, 8, 600), (64, 8, 600), (40, 4, 10_000), (300, 4, 120)])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_simulated_loads_and_stores_equal_the_closed_form(L, d_k, sram, algorithm):
    Q, K, V = np.random.default_rng(L + d_k).standard_normal((3, L, d_k))
    sim = simulate_traffic(Q, K, V, sram, algorithm)
    expected = traffic_breakdown(L, d_k, sram, algorithm)
    assert sim.reads == expected["reads"]
    assert sim.writes == expected["writes"]
    assert sim.peak <= sram
    assert_close(sim.out, scaled_dot_product_attention(Q, K, V)[0])
    total = sum(sim.reads.values()) + sum(sim.writes.values())
    assert hbm_traffic(L, d_k, sram, algorithm, "float32") == 4 * total


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
    # Θ(N² d² / M): doubling M nearly halves the traffic (less once the b² score tile matters)
    for small, large in zip(flash, flash[1:], strict=False):
        assert 0.5 < large / small < 0.7
    # the standard algorithm's 4N² of S and P stays whatever M is
    assert all(s > 4 * N * N * dtype_bytes("float16") for s in standard)
    assert standard[-1] / flash[-1] > 8 and standard[-2] / flash[-2] > 5
    # FlashAttention-2's loop order reads less than FlashAttention's: Q and O are not reloaded
    assert all(hbm_traffic(N, d, M, "flash2") < hbm_traffic(N, d, M, "flash1") for M in Ms)


def test_trace_of_one_row_ends_at_its_output():
    Q, K, V = np.random.default_rng(1).standard_normal((3, 50, 4))
    sim = simulate_traffic(Q, K, V, sram=200, algorithm="flash2")
    b = tile_size(4, 200)
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

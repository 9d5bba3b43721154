"""The expected values a release's visible tests compare with: ``solutions/<a>/expected.npz``.

Releases need only NumPy, matplotlib and Jupyter (``assignments/requirements.txt``), so the
reference layers their visible tests used to call are replaced by their outputs, computed here
from ``mha_lab`` and stored beside the notebook (nbgrader copies the file into the release).
``python -m mha_lab release-values`` (run by ``make assignments``) writes them.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from mha_lab.cpu import (
    GroupedQueryAttention,
    MultiHeadAttention,
    RotaryAttention,
    apply_rope,
    create_causal_mask,
    scaled_dot_product_attention,
    split_heads,
)
from mha_lab.cpu.paged import pack_sequences
from mha_lab.cpu.speculative import UniformDraw, residual, verify
from mha_lab.cpu.split_k import split_k_partials
from mha_lab.measure import traced_memory
from mha_lab.parallel.sequence import block_state, merge_states, ring_attention

__all__ = ["FILENAME", "VALUES", "main"]

FILENAME = "expected.npz"
REPO = Path(__file__).resolve().parents[2]


def _weights(layer: MultiHeadAttention | GroupedQueryAttention, prefix: str = "") -> dict[str, np.ndarray]:
    return {f"{prefix}W_{n}": getattr(layer, f"W_{n}") for n in "QKVO"}


def _ps1() -> dict[str, np.ndarray]:
    fused = MultiHeadAttention(d_model=16, num_heads=4, seed=0)
    X = np.random.default_rng(3).normal(size=(2, 6, 16))  # B=2, L=6, d_model=16
    return {**_weights(fused), "X": X, "out": fused.forward(X), "out_causal": fused.forward(X, create_causal_mask(6))}


def _ps2() -> dict[str, np.ndarray]:
    mqa = GroupedQueryAttention(d_model=4, num_heads=2, num_kv_heads=1, seed=0)
    X3 = np.random.default_rng(10).normal(size=(3, 3, 4))  # B=3: every sequence of a batch has its own keys
    gqa = GroupedQueryAttention(d_model=8, num_heads=4, num_kv_heads=2, seed=1)
    X8 = np.random.default_rng(1).normal(size=(2, 3, 8))  # B=2
    mha = MultiHeadAttention(d_model=8, num_heads=2, seed=2)
    decode = GroupedQueryAttention(d_model=8, num_heads=4, num_kv_heads=2, seed=3)
    X5 = np.random.default_rng(3).normal(size=(2, 5, 8))  # B=2, L=5
    return {**_weights(mqa, "mqa_"), "mqa_X": X3, "mqa_out": mqa.forward(X3),
            **_weights(gqa, "gqa_"), "gqa_X": X8, "gqa_out": gqa.forward(X8),
            **_weights(mha, "mha_"), "mha_out": mha.forward(X8),
            **_weights(decode, "decode_"), "decode_X": X5, "decode_out": decode.forward(X5, create_causal_mask(5))}


def _arrays_peak(fn: Callable[[], object]) -> int:
    """``fn``'s peak under tracemalloc rounded down to 64 KiB: its arrays' bytes (whole 64 KiB blocks here),
    without the few bytes of Python objects that change from run to run, so that the stored value does not. The
    smallest of three runs: what another thread of the process allocates meanwhile counts too, and can only add."""
    return traced_memory(fn, repeat=3)[1] // 2**16 * 2**16


def _ps3() -> dict[str, np.ndarray]:
    layer = MultiHeadAttention(d_model=8, num_heads=2, seed=0)
    X = np.random.default_rng(0).standard_normal((2, 5, 8))
    hot = MultiHeadAttention(d_model=8, num_heads=2, seed=0)
    hot.W_Q = 1000.0 * layer.W_Q  # scores in the thousands
    rng = np.random.default_rng(2)
    Q, K, V = (rng.standard_normal((2, 2, 6, 4)) for _ in range(3))  # B=2, h=2, L=6, d=4
    Qn, Kp = -1000.0 * np.abs(Q), np.abs(K) + 0.5  # every score of these rows is below -745

    def attend(*args: np.ndarray) -> np.ndarray:
        return scaled_dot_product_attention(*args)[0]

    rng_b = np.random.default_rng(1)  # the visible memory tests' inputs, made in the notebook the same way
    big = MultiHeadAttention(64, 16)
    big.W_Q, big.W_K, big.W_V, big.W_O = rng_b.standard_normal((4, 64, 64)) / 8
    Xb = rng_b.standard_normal((1, 256, 64))
    Qb, Kb, Vb = np.random.default_rng(3).standard_normal((3, 1, 4, 1024, 16))
    compare = MultiHeadAttention(128, 8, seed=0)  # the fused layer of the notebook's last, ungraded cell
    Xc = np.random.default_rng(0).standard_normal((1, 512, 128))
    return {**_weights(layer), "X": X, "out": layer.forward(X), "out_causal": layer.forward(X, create_causal_mask(5)),
            "out_hot": hot.forward(X), "Q": Q, "K": K, "V": V, "chunked": attend(Q, K, V),
            "chunked_causal": attend(Q, K, V, create_causal_mask(6)), "chunked_large": attend(100.0 * Q, K, V),
            "Qn": Qn, "Kp": Kp, "chunked_negative": attend(Qn, Kp, V), "big_rows": big.forward(Xb)[:, :8],
            "chunked_big_rows": attend(Qb, Kb, Vb)[:, :, :8],
            "compare_fused_peak": np.array(_arrays_peak(lambda: compare.forward(Xc)))}


def _ps4() -> dict[str, np.ndarray]:
    values = {}
    for name, seed, shape, bias, mask in (("", 0, (2, 3, 8), False, None), ("b_", 2, (3, 4, 8), True, None),
                                          ("c_", 3, (2, 4, 8), False, create_causal_mask(4))):
        rng = np.random.default_rng(seed)
        layer = MultiHeadAttention(8, 2, use_bias=bias)
        for n in "QKVO":
            setattr(layer, f"W_{n}", rng.standard_normal((8, 8)) / np.sqrt(8))
        if bias:
            for n in "QKVO":
                setattr(layer, f"b_{n}", 0.1 * rng.standard_normal(8))
        X = np.random.default_rng(10 + seed).standard_normal(shape)
        G = np.random.default_rng(20 + seed).standard_normal(shape)
        layer.forward(X, mask)
        values |= {f"{name}X": X, f"{name}G": G, f"{name}grad_X": layer.backward(G)}
        values |= {f"{name}{k}": getattr(layer, k) for k in layer.gradients()}
        values |= {f"{name}grad_{k}": v for k, v in layer.gradients().items()}
    return values


def _ps5() -> dict[str, np.ndarray]:
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 8))  # (B, h, L, d)
    positions = np.arange(5, 9)
    layer = RotaryAttention(d_model=16, num_heads=4, seed=5)
    rng = np.random.default_rng(6)
    cached = [5, 2, 9]  # positions each sequence has cached
    X = [rng.standard_normal((1, t + 3, 16)) for t in cached]  # each: its cached tokens, then 3 new ones
    keys = [layer.rotate(split_heads(Xb @ layer.W_K, 4), 0)[0] for Xb in X]  # (h, T + 3, d_k), rotated
    values = [split_heads(Xb @ layer.W_V, 4)[0] for Xb in X]
    k_pool, v_pool, tables, lengths = pack_sequences([k[:, :t] for k, t in zip(keys, cached, strict=True)],
                                                     [v[:, :t] for v, t in zip(values, cached, strict=True)],
                                                     block_size=4, capacity=16, seed=7)
    # each sequence's causal forward, at its three new positions: (B, 3, d_model)
    out = np.concatenate([layer.forward(Xb, create_causal_mask(Xb.shape[1]))[:, -3:] for Xb in X])
    unscaled = copy.deepcopy(layer)  # scores q . k without 1/sqrt(d_k): the queries scaled up by sqrt(d_k)
    unscaled.W_Q = layer.W_Q * np.sqrt(layer.d_k)
    out_unscaled = np.concatenate([unscaled.forward(Xb, create_causal_mask(Xb.shape[1]))[:, -3:] for Xb in X])
    q, K, V = (np.random.default_rng(8).standard_normal(s) for s in ((2, 3, 1, 8), (2, 3, 40, 8), (2, 3, 40, 8)))
    m, l, acc = split_k_partials(q, K, V, num_splits=4)
    big = 1000.0 * q  # scores in the thousands, with row maxima thousands apart
    m_big, l_big, acc_big = split_k_partials(big, K, V, num_splits=4)
    return {"rope_x": x, "rope_positions": positions, "rope_out": apply_rope(x, positions),
            **_weights(layer, "paged_"), "paged_X_new": np.concatenate([Xb[:, -3:] for Xb in X]),
            "paged_k_pool": k_pool, "paged_v_pool": v_pool, "paged_tables": tables, "paged_lengths": lengths,
            "paged_k_new": np.stack([k[:, t] for k, t in zip(keys, cached, strict=True)]), "paged_out": out,
            "paged_out_unscaled": out_unscaled,
            "merge_m": m, "merge_l": l, "merge_acc": acc, "merge_out": scaled_dot_product_attention(q, K, V)[0],
            "merge_large_m": m_big, "merge_large_l": l_big, "merge_large_acc": acc_big,
            "merge_large_out": scaled_dot_product_attention(big, K, V)[0]}


def _speculative(p: np.ndarray, q: np.ndarray, drafted: np.ndarray, u: np.ndarray, r: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The modified rejection rule on each row, with its given uniforms: (accepted drafts, next token), each (B,)."""
    out = [verify(p[b], q[b], list(drafted[b]), UniformDraw(u[b], r[b])) for b in range(len(drafted))]
    return np.array([len(t) - 1 for t in out]), np.array([t[-1] for t in out])


def _ps6() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(60)
    q, k, v = rng.standard_normal((2, 3, 5, 4)), rng.standard_normal((2, 3, 7, 4)), rng.standard_normal((2, 3, 7, 4))
    qc, kc, vc = rng.standard_normal((3, 2, 3, 6, 4))  # (B=2, h=3, L=6, d=4), causal
    k2, v2 = rng.standard_normal((2, 2, 3, 9, 4))  # a second block of keys for the same queries
    Q, K, V = rng.standard_normal((3, 2, 2, 12, 4))  # (B=2, h=2, L=12, d=4): 3 ranks, 6 zigzag chunks
    V_size, k_draft = 5, 2
    P = rng.dirichlet(np.ones(V_size), size=(3, k_draft + 1))  # (B=3, k+1, V)
    Qd = rng.dirichlet(np.ones(V_size), size=(3, k_draft))  # (B=3, k, V)
    drafted = np.array([[int(rng.choice(V_size, p=Qd[b, i])) for i in range(k_draft)] for b in range(3)])
    accept = np.minimum(1.0, np.take_along_axis(P[:, :k_draft], drafted[..., None], -1)[..., 0]
                        / np.take_along_axis(Qd, drafted[..., None], -1)[..., 0])  # (B, k)
    # row 0 keeps both drafts, row 1 rejects the first, row 2 keeps one and rejects the second
    u = np.where(np.array([[0, 0], [1, 0], [0, 1]]) == 1, (1 + accept) / 2, accept / 2)
    r = rng.random(3)
    n, nxt = _speculative(P, Qd, drafted, u, r)
    state, big = block_state(q, k, v), block_state(300.0 * q, k, v)
    second, big2 = block_state(q, k2, v2), block_state(300.0 * q, k2, v2)
    both = np.concatenate([k, k2], axis=-2), np.concatenate([v, v2], axis=-2)
    return {"block_q": q, "block_k": k, "block_v": v, **_state("block_", state), "block_qc": qc, "block_kc": kc,
            "block_vc": vc, **_state("block_causal_", block_state(qc, kc, vc, True)),
            **_state("merge_", state, "_a"), **_state("merge_", second, "_b"),
            **_state("merge_", merge_states(*state, *second)), "merge_out": scaled_dot_product_attention(q, *both)[0],
            **_state("merge_large_", big, "_a"), **_state("merge_large_", big2, "_b"),
            "merge_large_out": scaled_dot_product_attention(300.0 * q, *both)[0],
            "ring_Q": Q, "ring_K": K, "ring_V": V, "ring_out": ring_attention(Q, K, V, 3),
            "ring_causal_out": ring_attention(Q, K, V, 3, causal=True),
            "spec_p": P, "spec_q": Qd, "spec_drafted": drafted, "spec_u": u, "spec_r": r,
            "spec_residual": np.stack([residual(P[b, 0], Qd[b, 0]) for b in range(3)]),
            "spec_n_accepted": n, "spec_next_token": nxt}


def _state(prefix: str, state: tuple[np.ndarray, ...], suffix: str = "") -> dict[str, np.ndarray]:
    """An online-softmax state (m, l, acc) under the names ``<prefix>m<suffix>``, ``...l...``, ``...acc...``."""
    return {f"{prefix}{n}{suffix}": x for n, x in zip(("m", "l", "acc"), state, strict=True)}


VALUES: dict[str, Callable[[], dict[str, np.ndarray]]] = {
    "ps1_per_head_loop": _ps1, "ps2_mqa": _ps2, "ps3_memory_efficient": _ps3, "ps4_backward": _ps4,
    "ps5_decoding": _ps5, "ps6_ring_speculative": _ps6}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mha_lab release-values", description=__doc__.splitlines()[0])
    parser.add_argument("assignment", nargs="*", help="default: every assignment")
    parser.add_argument("--course", type=Path, default=REPO, help="course root (default: this repository)")
    args = parser.parse_args(argv)
    for a in args.assignment or sorted(VALUES):
        out = args.course / "solutions" / a / FILENAME
        np.savez(out, **VALUES[a]())
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

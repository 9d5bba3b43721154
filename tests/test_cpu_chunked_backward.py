"""The chunked backward and gradient checkpointing: the fused layer's gradients, less memory."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mha_lab.cpu import (
    Checkpointed,
    ChunkedLayer,
    GroupedQueryAttention,
    chunked_attention,
    chunked_attention_backward,
    create_causal_mask,
)
from mha_lab.measure import traced_memory
from mha_lab.testing import assert_close


def qkv(B, h, h_kv, Lq, Lk, d, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, h, Lq, d)), rng.standard_normal((B, h_kv, Lk, d)),
            rng.standard_normal((B, h_kv, Lk, d)), rng.standard_normal((B, h, Lq, d)))


def autograd_reference(Q, K, V, grad_O, mask=None):
    """torch autograd through softmax(Q K^T / sqrt(d) + M) V with K/V heads repeated: an independent peer."""
    q, k, v = (torch.tensor(t, requires_grad=True) for t in (Q, K, V))
    n_rep = Q.shape[1] // K.shape[1]
    kr, vr = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    s = q @ kr.transpose(-1, -2) / np.sqrt(Q.shape[-1])
    if mask is not None:
        s = s + torch.from_numpy(mask)
    (torch.softmax(s, dim=-1) @ vr).backward(torch.from_numpy(grad_O))
    return torch.logsumexp(s, dim=-1).detach().numpy(), q.grad.numpy(), k.grad.numpy(), v.grad.numpy()


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 2), st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]), st.integers(1, 23),
       st.integers(1, 9), st.integers(1, 9), st.booleans())
def test_chunked_backward_equals_autograd(B, heads, L, block_q, block_k, causal):
    h, h_kv = heads
    Q, K, V, G = qkv(B, h, h_kv, L, L, 4, seed=L)
    blocks = {"block_q": block_q, "block_k": block_k}
    O, lse = chunked_attention(Q, K, V, causal=causal, return_lse=True, **blocks)
    grads = chunked_attention_backward(G, Q, K, V, O, lse, causal=causal, **blocks)
    ref_lse, *ref_grads = autograd_reference(Q, K, V, G, create_causal_mask(L) if causal else None)
    assert_close(lse, ref_lse)
    for got, want in zip(grads, ref_grads, strict=True):
        assert got.shape == want.shape
        assert_close(got, want)


def test_chunked_backward_with_padding_mask_and_cross_lengths():
    Q, K, V, G = qkv(2, 4, 2, 7, 13, 5, seed=1)
    pad = np.zeros((2, 1, 1, 13))
    pad[1, ..., 10:] = -np.inf  # the second sequence's last three keys are padding
    O, lse = chunked_attention(Q, K, V, mask=pad, block_q=3, block_k=4, return_lse=True)
    grads = chunked_attention_backward(G, Q, K, V, O, lse, mask=pad, block_q=3, block_k=4)
    for got, want in zip(grads, autograd_reference(Q, K, V, G, pad)[1:], strict=True):
        assert_close(got, want)
    assert np.all(grads[1][1, :, 10:] == 0) and np.all(grads[2][1, :, 10:] == 0)  # padded keys learn nothing


def test_chunked_backward_never_forms_an_L_by_L_matrix():
    L, h, d = 512, 2, 16
    Q, K, V, G = qkv(1, h, h, L, L, d, seed=3)
    O, lse = chunked_attention(Q, K, V, causal=True, return_lse=True)
    _, peak = traced_memory(  # the smaller of two runs: another thread's allocations count too
        lambda: chunked_attention_backward(G, Q, K, V, O, lse, causal=True, block_q=64, block_k=64), repeat=2)
    one_head_scores = L * L * 8  # a single (L, L) float64 matrix; the fused backward holds h of them, 3 times
    assert peak < one_head_scores, f"peak {peak} bytes: an (L, L) buffer was formed"


@pytest.mark.parametrize("h, h_kv, causal, bias", [(4, 4, True, True), (4, 2, False, False), (3, 1, True, False)])
def test_chunked_layer_and_checkpointing_give_the_fused_gradients(h, h_kv, causal, bias):
    B, L, d_model = 2, 19, 12
    X = np.random.default_rng(0).standard_normal((B, L, d_model))
    G = np.random.default_rng(1).standard_normal((B, L, d_model))
    mask = create_causal_mask(L) if causal else None
    fused = GroupedQueryAttention(d_model, h, h_kv, use_bias=bias, seed=2)
    out = fused.forward(X, mask)
    grad_X = fused.backward(G)
    expected = {n: g.copy() for n, g in fused.gradients().items()}
    for make in (lambda layer: ChunkedLayer(layer, causal=causal, block_q=4, block_k=8),
                 lambda layer: Checkpointed(layer)):
        layer = GroupedQueryAttention(d_model, h, h_kv, use_bias=bias, seed=2)
        step = make(layer)
        assert_close(step.forward(X, None if isinstance(step, ChunkedLayer) else mask), out)
        assert_close(step.backward(G), grad_X)
        for name, g in layer.gradients().items():
            assert_close(g, expected[name], err_msg=f"{type(step).__name__} {name}")


def test_checkpointed_keeps_only_the_input_between_forward_and_backward():
    layer = GroupedQueryAttention(8, 2, 2, seed=0)
    X = np.random.default_rng(0).standard_normal((1, 6, 8))
    step = Checkpointed(layer)
    step.forward(X)
    assert layer._cache is None and layer.attention_weights is None
    assert step._saved[0] is X
    step.backward(np.ones_like(X))
    assert layer._cache is None
    with pytest.raises(RuntimeError, match="before forward"):
        step.backward(np.ones_like(X))


def test_chunked_backward_errors():
    Q, K, V, G = qkv(1, 2, 2, 4, 4, 3)
    O, lse = chunked_attention(Q, K, V, return_lse=True)
    with pytest.raises(ValueError, match="lse"):
        chunked_attention_backward(G, Q, K, V, O, lse[..., :3])
    with pytest.raises(RuntimeError, match="before forward"):
        ChunkedLayer(GroupedQueryAttention(4, 2, 2)).backward(np.ones((1, 3, 4)))


def test_measured_backward_costs_order_the_three_methods():
    from mha_lab.plots.cost import backward_costs

    rows = {r["method"]: r for r in backward_costs((96,), d_model=32, n_heads=4, block=16, repeat=1)}
    assert set(rows) == {"fused", "checkpointed", "chunked"}
    a_bytes = 4 * 96 * 96 * 8  # the fused layer's (B, h, L, L) weights
    assert rows["fused"]["kept"] >= a_bytes > rows["chunked"]["kept"] > rows["checkpointed"]["kept"]
    assert rows["chunked"]["peak"] < rows["fused"]["peak"] <= rows["checkpointed"]["peak"] + a_bytes
    assert all(r["seconds"] > 0 for r in rows.values())

"""The NumPy reference against real peers: torch.nn.MultiheadAttention and F.scaled_dot_product_attention."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from mha_lab.cpu import (  # noqa: E402
    GroupedQueryAttention,
    MultiHeadAttention,
    create_causal_mask,
    scaled_dot_product_attention,
    scaled_dot_product_attention_backward,
    split_heads,
)
from mha_lab.cuda.attention import torch_multihead_attention  # noqa: E402
from mha_lab.testing import assert_close  # noqa: E402


@pytest.mark.parametrize("B, L, d, h", [(1, 1, 8, 2), (3, 7, 12, 3), (2, 97, 32, 4)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_forward_and_gradients_match_torch_multihead_attention(B, L, d, h, causal, bias):
    rng = np.random.default_rng(L)
    mha = MultiHeadAttention(d, h, use_bias=bias, seed=L)
    if bias:
        for n in "QKVO":
            setattr(mha, f"b_{n}", rng.standard_normal(d))
    ref = torch_multihead_attention(mha)
    X, G = rng.standard_normal((B, L, d)), rng.standard_normal((B, L, d))
    mask = create_causal_mask(L) if causal else None

    out = mha.forward(X, mask)
    grad_X = mha.backward(G)

    Xt = torch.from_numpy(X).requires_grad_(True)
    out_t, w_t = ref(Xt, Xt, Xt, attn_mask=None if mask is None else torch.from_numpy(mask[0, 0]),
                     need_weights=True, average_attn_weights=False)
    (out_t * torch.from_numpy(G)).sum().backward()

    assert_close(out, out_t.detach().numpy())
    assert_close(mha.attention_weights, w_t.detach().numpy())
    assert_close(grad_X, Xt.grad.numpy())
    W_in = ref.in_proj_weight.grad.numpy().T  # (d, 3d): columns [Q | K | V]
    for i, n in enumerate("QKV"):
        assert_close(getattr(mha, f"grad_W_{n}"), W_in[:, i * d:(i + 1) * d], err_msg=n)
    assert_close(mha.grad_W_O, ref.out_proj.weight.grad.numpy().T)
    if bias:
        b_in = ref.in_proj_bias.grad.numpy()
        for i, n in enumerate("QKV"):
            assert_close(getattr(mha, f"grad_b_{n}"), b_in[i * d:(i + 1) * d], err_msg=n)
        assert_close(mha.grad_b_O, ref.out_proj.bias.grad.numpy())


@pytest.mark.parametrize("h, g", [(4, 1), (4, 2), (6, 3), (4, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_matches_torch_sdpa_enable_gqa(h, g, causal):
    d_k, B, L = 5, 2, 13
    gqa = GroupedQueryAttention(h * d_k, h, g, seed=h + g)
    X = np.random.default_rng(g).standard_normal((B, L, h * d_k))
    out = gqa.forward(X, create_causal_mask(L) if causal else None)

    Q = torch.from_numpy(split_heads(X @ gqa.W_Q, h))  # (B, L, d_model) -> (B, h, L, d_k)
    K = torch.from_numpy(split_heads(X @ gqa.W_K, g))  # (B, L, g*d_k) -> (B, g, L, d_k)
    V = torch.from_numpy(split_heads(X @ gqa.W_V, g))
    Z = F.scaled_dot_product_attention(Q, K, V, is_causal=causal, enable_gqa=True)  # (B, h, L, d_k)
    expected = Z.transpose(1, 2).reshape(B, L, h * d_k).numpy() @ gqa.W_O  # (B, h, L, d_k) -> (B, L, d_model)
    assert_close(out, expected)


def test_gqa_gradients_match_torch_autograd():
    h, g, d_k, B, L = 6, 2, 4, 2, 9
    gqa = GroupedQueryAttention(h * d_k, h, g, use_bias=True, seed=0)
    rng = np.random.default_rng(0)
    X, G = rng.standard_normal((B, L, h * d_k)), rng.standard_normal((B, L, h * d_k))
    gqa.forward(X, create_causal_mask(L))
    grad_X = gqa.backward(G)

    t = {n: torch.from_numpy(v.copy()).requires_grad_(True) for n, v in gqa.parameters().items()}
    Xt = torch.from_numpy(X).requires_grad_(True)
    Q = (Xt @ t["W_Q"] + t["b_Q"]).view(B, L, h, d_k).transpose(1, 2)  # (B, L, d) -> (B, h, L, d_k)
    K = (Xt @ t["W_K"] + t["b_K"]).view(B, L, g, d_k).transpose(1, 2)  # (B, L, g*d_k) -> (B, g, L, d_k)
    V = (Xt @ t["W_V"] + t["b_V"]).view(B, L, g, d_k).transpose(1, 2)
    Z = F.scaled_dot_product_attention(Q, K, V, is_causal=True, enable_gqa=True)
    out = Z.transpose(1, 2).reshape(B, L, h * d_k) @ t["W_O"] + t["b_O"]  # (B, h, L, d_k) -> (B, L, d)
    (out * torch.from_numpy(G)).sum().backward()

    assert_close(grad_X, Xt.grad.numpy())
    for name, grad in gqa.gradients().items():
        assert_close(grad, t[name].grad.numpy(), err_msg=name)


@pytest.mark.parametrize("h, h_kv, L_q, L_k", [(3, 3, 7, 7), (4, 2, 7, 7), (6, 1, 5, 9), (4, 2, 1, 6)])
@pytest.mark.parametrize("masked", [False, True])
def test_sdpa_backward_matches_torch_autograd(h, h_kv, L_q, L_k, masked):
    """Steps 3-5 alone against autograd through F.scaled_dot_product_attention, for MHA, GQA and MQA."""
    B, d_k, d_v = 2, 5, 3
    rng = np.random.default_rng(h + h_kv + L_q)
    Q, K, V = (rng.standard_normal(s) for s in ((B, h, L_q, d_k), (B, h_kv, L_k, d_k), (B, h_kv, L_k, d_v)))
    G = rng.standard_normal((B, h, L_q, d_v))
    mask = None
    if masked:  # causal (bottom-right) and, in batch 0, the last key padded out: -inf entries
        mask = np.broadcast_to(create_causal_mask(L_q, key_len=L_k), (B, 1, L_q, L_k)).copy()
        mask[0, ..., -1] = -np.inf
    Z, A = scaled_dot_product_attention(Q, K, V, mask, enable_gqa=True)
    grads = scaled_dot_product_attention_backward(G, Q, K, V, A)

    Qt, Kt, Vt = (torch.from_numpy(x).requires_grad_(True) for x in (Q, K, V))
    Zt = F.scaled_dot_product_attention(Qt, Kt, Vt, attn_mask=None if mask is None else torch.from_numpy(mask),
                                        enable_gqa=h != h_kv)
    (Zt * torch.from_numpy(G)).sum().backward()

    assert_close(Z, Zt.detach().numpy())
    for name, grad, ref in zip("QKV", grads, (Qt, Kt, Vt), strict=True):
        assert grad.shape == ref.shape, name
        assert_close(grad, ref.grad.numpy(), err_msg=f"grad_{name}")

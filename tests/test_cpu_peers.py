"""The NumPy reference against real peers: torch.nn.MultiheadAttention and F.scaled_dot_product_attention."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from mha_lab.cpu import GroupedQueryAttention, MultiHeadAttention, create_causal_mask, split_heads  # noqa: E402
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

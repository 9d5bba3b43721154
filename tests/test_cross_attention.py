"""Cross-attention (queries from X, keys and values from X_kv, L_q != L_k) in NumPy and PyTorch."""

import numpy as np
import pytest

from mha_lab.cpu import GroupedQueryAttention, MultiHeadAttention, create_causal_mask
from mha_lab.gradcheck import check_layer_gradients
from mha_lab.testing import GRADCHECK_EPS, GRADCHECK_MAX_REL_ERROR, assert_close

torch = pytest.importorskip("torch")
F = torch.nn.functional

from mha_lab.cuda import MultiHeadAttention as TorchMHA  # noqa: E402
from mha_lab.cuda.attention import causal_mask, torch_multihead_attention  # noqa: E402


def _padding(lengths: list[int], L_k: int) -> np.ndarray:
    """Additive key-padding mask (B, 1, 1, L_k): -inf on the keys past each sequence's length."""
    is_pad = np.arange(L_k)[None, :] >= np.array(lengths)[:, None]  # (B, L_k)
    return np.where(is_pad, -np.inf, 0.0)[:, None, None, :]  # (B, L_k) -> (B, 1, 1, L_k)


@pytest.mark.parametrize("L_q, L_k", [(1, 7), (5, 3), (4, 9)])
@pytest.mark.parametrize("bias", [False, True])
def test_cross_attention_matches_torch_multihead_attention(L_q, L_k, bias):
    rng = np.random.default_rng(L_q * 10 + L_k)
    B, d, h = 3, 12, 3
    mha = MultiHeadAttention(d, h, use_bias=bias, seed=L_k)
    if bias:
        for n in "QKVO":
            setattr(mha, f"b_{n}", rng.standard_normal(d))
    X, X_kv, G = (rng.standard_normal((B, n, d)) for n in (L_q, L_k, L_q))
    lengths = [L_k, max(1, L_k - 2), 1]
    out = mha.forward(X, _padding(lengths, L_k), X_kv=X_kv)
    grad_X, grad_X_kv = mha.backward(G)

    ref = torch_multihead_attention(mha)
    Xt, Xkv_t = (torch.from_numpy(a).requires_grad_(True) for a in (X, X_kv))
    is_pad = torch.arange(L_k)[None, :] >= torch.tensor(lengths)[:, None]  # (B, L_k), True = ignore
    out_t, w_t = ref(Xt, Xkv_t, Xkv_t, key_padding_mask=is_pad, average_attn_weights=False)
    (out_t * torch.from_numpy(G)).sum().backward()

    assert out.shape == (B, L_q, d) and mha.attention_weights.shape == (B, h, L_q, L_k)
    assert_close(out, out_t.detach().numpy())
    assert_close(mha.attention_weights, w_t.detach().numpy())
    assert np.all(mha.attention_weights[2, :, :, 1:] == 0)  # sequence 2 has one real key
    assert_close(grad_X, Xt.grad.numpy())
    assert_close(grad_X_kv, Xkv_t.grad.numpy())
    W_in = ref.in_proj_weight.grad.numpy().T  # (d, 3d): columns [Q | K | V]
    for i, n in enumerate("QKV"):
        assert_close(getattr(mha, f"grad_W_{n}"), W_in[:, i * d:(i + 1) * d], err_msg=n)


@pytest.mark.parametrize("layer", [MultiHeadAttention(8, 2, use_bias=True, seed=0),
                                   GroupedQueryAttention(12, 4, 2, use_bias=True, seed=1)], ids=["mha", "gqa"])
def test_cross_attention_gradients_match_central_differences(layer):
    rng = np.random.default_rng(3)
    X, X_kv = rng.standard_normal((2, 3, layer.d_model)), rng.standard_normal((2, 6, layer.d_model))
    errors = check_layer_gradients(layer, X, _padding([6, 4], 6), eps=GRADCHECK_EPS, X_kv=X_kv)
    assert {"X", "X_kv", "W_K", "b_V"} <= set(errors)
    bad = {k: v for k, v in errors.items() if not v < GRADCHECK_MAX_REL_ERROR}
    assert not bad, f"gradient check failed: {bad}"


def test_self_attention_is_cross_attention_with_x_kv_equal_to_x():
    layer = GroupedQueryAttention(12, 4, 2, seed=2)
    X, G = np.random.default_rng(4).standard_normal((2, 2, 5, 12))
    out_self = layer.forward(X, create_causal_mask(5))
    grad_self = layer.backward(G)
    out_cross = layer.forward(X, create_causal_mask(5), X_kv=X.copy())
    grad_q, grad_kv = layer.backward(G)
    assert_close(out_cross, out_self)
    assert_close(grad_q + grad_kv, grad_self)  # self-attention's dL/dX is the sum of both branches
    assert np.abs(grad_kv).max() > 1e-3 and np.abs(grad_q).max() > 1e-3


def test_cross_attention_rejects_mismatched_inputs():
    layer = MultiHeadAttention(8, 2, seed=0)
    X = np.zeros((2, 3, 8))
    with pytest.raises(ValueError, match="batch size"):
        layer.forward(X, X_kv=np.zeros((1, 4, 8)))
    with pytest.raises(ValueError, match="d_model=6"):
        layer.forward(X, X_kv=np.zeros((2, 4, 6)))
    with pytest.raises(ValueError, match=r"\(B, h, L_q, L_k\)"):
        layer.forward(X, create_causal_mask(3), X_kv=np.zeros((2, 4, 8)))  # a (3, 3) mask for L_k = 4


def test_bottom_right_causal_mask_matches_torch():
    from torch.nn.attention.bias import causal_lower_right

    for L_q, L_k in ((3, 5), (4, 4), (1, 6)):
        lower_right = causal_lower_right(L_q, L_k)._materialize()  # (L_q, L_k), True = may attend
        assert torch.equal(causal_mask(L_q, L_k=L_k), lower_right)
        assert np.array_equal(create_causal_mask(L_q, key_len=L_k)[0, 0] == 0, lower_right.numpy())
    assert np.array_equal(create_causal_mask(2, window=2, key_len=4)[0, 0] == 0,
                          [[False, True, True, False], [False, False, True, True]])
    with pytest.raises(ValueError, match="key_len=2 < seq_len=3"):
        create_causal_mask(3, key_len=2)


def test_is_causal_aligns_top_left_and_the_module_bottom_right():
    """The trap of pytorch #108108: with L_q < L_k, is_causal=True hides keys the queries should see."""
    L_q, L_k = 3, 5
    q, k, v = torch.randn(1, 2, L_q, 8, dtype=torch.float64), *torch.randn(2, 1, 2, L_k, 8, dtype=torch.float64)
    top_left = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    upper_left_mask = torch.ones(L_q, L_k, dtype=torch.bool).tril()
    assert_close(top_left.numpy(), F.scaled_dot_product_attention(q, k, v, attn_mask=upper_left_mask).numpy())
    bottom_right = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(L_q, L_k=L_k))
    assert (top_left - bottom_right).abs().max() > 0.1  # the two alignments disagree
    # the last query sees every key under bottom-right alignment: the unmasked attention's last row
    assert_close(bottom_right[..., -1, :].numpy(), F.scaled_dot_product_attention(q, k, v)[..., -1, :].numpy())


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("causal", [False, True])
def test_torch_module_cross_attention_matches_numpy(backend, causal):
    rng = np.random.default_rng(5)
    B, L_q, L_k, d = 2, 4, 7, 12
    layer = GroupedQueryAttention(d, 4, 2, use_bias=True, seed=5)
    X, X_kv, G = rng.standard_normal((B, L_q, d)), rng.standard_normal((B, L_k, d)), rng.standard_normal((B, L_q, d))
    mask = _padding([7, 5], L_k)
    if causal:
        mask = mask + create_causal_mask(L_q, key_len=L_k)
    out = layer.forward(X, mask, X_kv=X_kv)
    grad_X, grad_X_kv = layer.backward(G)

    module = TorchMHA.from_numpy(layer, causal=causal, backend=backend)
    Xt, Xkv_t = (torch.from_numpy(a).requires_grad_(True) for a in (X, X_kv))
    keep = torch.from_numpy(mask == 0).reshape(B, 1, 1 if not causal else L_q, L_k)  # True = may attend
    out_t = module(Xt, keep if not causal else torch.from_numpy(_padding([7, 5], L_k) == 0), x_kv=Xkv_t)
    (out_t * torch.from_numpy(G)).sum().backward()
    assert_close(out_t.detach().numpy(), out)
    assert_close(Xt.grad.numpy(), grad_X)
    assert_close(Xkv_t.grad.numpy(), grad_X_kv)
    if causal:  # without a padding mask the module must still align the causal mask bottom-right
        no_pad = layer.forward(X, create_causal_mask(L_q, key_len=L_k), X_kv=X_kv)
        assert_close(module(Xt, x_kv=Xkv_t).detach().numpy(), no_pad)


def test_torch_module_rejects_bad_cross_inputs():
    module = TorchMHA(8, 2, causal=True, backend="eager")
    x = torch.zeros(2, 4, 8)
    with pytest.raises(ValueError, match="batch size"):
        module(x, x_kv=torch.zeros(3, 4, 8))
    with pytest.raises(ValueError, match="L_k >= L_q"):
        module(x, x_kv=torch.zeros(2, 3, 8))
    with pytest.raises(ValueError, match=r"\(B, h, L_q, L_k\)"):
        module(x, torch.ones(4, 4, dtype=torch.bool), x_kv=torch.zeros(2, 6, 8))


def test_triton_backend_names_its_length_limit_for_cross_attention():
    module = TorchMHA(32, 2, backend="triton")
    with pytest.raises(ValueError, match="L_k=5 and L_q=3"):
        module(torch.zeros(1, 3, 32), x_kv=torch.zeros(1, 5, 32))

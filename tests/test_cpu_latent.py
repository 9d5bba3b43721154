"""Multi-head latent attention: the latent cache decodes exactly what the uncompressed layer computes."""

import numpy as np
import pytest

from mha_lab.analysis import DEEPSEEK_V2, ModelConfig, kv_cache_bytes, kv_elements_per_token
from mha_lab.cpu import LatentAttention, create_causal_mask
from mha_lab.plots.cost import kv_variants_table
from mha_lab.testing import assert_close

rng = np.random.default_rng(0)


def small(seed: int = 0) -> LatentAttention:
    return LatentAttention(d_model=24, num_heads=3, head_dim=6, latent_dim=10, rope_dim=4, seed=seed)


@pytest.mark.parametrize("prompt", [1, 5])
def test_latent_decoding_equals_the_uncompressed_causal_forward(prompt):
    layer, L = small(), 9
    X = rng.standard_normal((2, L, 24))
    cache = layer.new_cache(batch_size=2, max_len=L)
    outs = [layer.prefill(X[:, :prompt], cache)]
    outs += [layer.decode_step(X[:, t:t + 1], cache) for t in range(prompt, L)]
    assert_close(np.concatenate(outs, axis=1), layer.forward(X, create_causal_mask(L)))
    config = ModelConfig("tiny", n_layers=1, d_model=24, n_heads=3, n_kv_heads=3, head_dim=6,
                         kv_latent_dim=10, rope_head_dim=4)
    assert cache.nbytes == kv_cache_bytes(config, L, batch_size=2, dtype="float64")  # latent + RoPE key only
    with pytest.raises(ValueError, match="full"):
        layer.decode_step(X[:, :1], cache)


def test_forward_is_mha_on_the_up_projected_keys_and_values():
    """Uncompressed MLA is attention over [q_C, q_R] . [k_C, k_R] / sqrt(d_k + d_R), head by head."""
    layer, X = small(1), rng.standard_normal((1, 5, 24))
    q_c, q_r = layer.queries(X)
    c, k_r = layer.compress(X)
    out = np.zeros((1, 5, 24))
    for i in range(3):
        cols = slice(6 * i, 6 * i + 6)
        k_c = c @ layer.W_UK[:, cols]  # (1, L, d_k)
        s = (q_c[:, i] @ k_c.transpose(0, 2, 1) + q_r[:, i] @ k_r.transpose(0, 2, 1)) / np.sqrt(6 + 4)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        out += a @ (c @ layer.W_UV[:, cols]) @ layer.W_O[cols]
    assert_close(layer.forward(X), out)


class _RotatedContent(LatentAttention):
    """A plausible bug: RoPE applied to the content query q_C as well as to its RoPE part q_R."""

    def queries(self, X: np.ndarray, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
        q_c, q_r = super().queries(X, offset)
        return self._rotate(q_c, offset), q_r


def test_scores_depend_on_positions_only_through_their_distance():
    """The causal forward of tokens at positions 1000..1008 equals the forward at 0..8: the content part
    q_C . k_C has no position and the RoPE part (R_m q_R) . (R_n k_R) only n - m.

    The bug it catches (``_RotatedContent``): rotating q_C too. The decoding test does not see it, since
    the uncompressed forward and the absorbed decoding read the same rotated queries; but q_C then meets
    unrotated keys, and the scores depend on the query's absolute position."""
    X, mask = rng.standard_normal((2, 9, 24)), create_causal_mask(9)
    for layer, exact in ((small(2), True), (_RotatedContent(24, 3, 6, 10, 4, seed=2), False)):
        shift = np.abs(layer.forward(X, mask, offset=1000) - layer.forward(X, mask)).max()
        assert (shift < 1e-12) == exact, (type(layer).__name__, shift)


def test_deepseek_v2_cache_is_576_numbers_per_token_and_layer():
    assert kv_elements_per_token(DEEPSEEK_V2) == 576 and DEEPSEEK_V2.kind == "MLA"
    assert kv_cache_bytes(DEEPSEEK_V2, 1, dtype="float16") == 576 * 60 * 2
    table = kv_variants_table(DEEPSEEK_V2)
    assert "| MHA | 32,768 |" in table and "| MLA | 576 |" in table and "56.9" in table
    with pytest.raises(ValueError, match="no latent"):
        kv_variants_table(ModelConfig("x", 1, 8, 2, 2, 4))


def test_latent_attention_rejects_bad_input():
    with pytest.raises(ValueError, match="even"):
        LatentAttention(d_model=8, num_heads=2, head_dim=4, latent_dim=4, rope_dim=3)
    with pytest.raises(ValueError, match="d_model"):
        small().forward(np.zeros((1, 2, 23)))
    with pytest.raises(ValueError, match="one token"):
        small().decode_step(np.zeros((1, 2, 24)), small().new_cache(1, 4))


def test_decoding_applies_w_uv_then_w_o_and_never_forms_their_product(monkeypatch):
    """The value side of a decoding step is ((sum_j a_j c_j) W_UV_i) W_O_i: a (d_c x d_model) product per
    head is never built. Every matrix product the step runs has W_O (h d_k x d_model) or a (d_c, d_k)
    head of W_UV as its right operand, never a (d_c, d_model) one."""
    layer = small(3)
    cache = layer.new_cache(batch_size=1, max_len=4)
    layer.prefill(rng.standard_normal((1, 3, 24)), cache)
    seen = []
    real_matmul = np.ndarray.__matmul__

    class Spy(np.ndarray):
        def __matmul__(self, other):
            seen.append(np.shape(other)[-2:])
            return real_matmul(np.asarray(self), np.asarray(other))

        def __rmatmul__(self, other):
            seen.append(np.shape(self)[-2:])
            return real_matmul(np.asarray(other), np.asarray(self))

    W_UK, W_UV = layer.head_projections()
    assert W_UV.shape == (3, 10, 6) and W_UK.shape == (3, 6, 10)
    monkeypatch.setattr(layer, "head_projections", lambda: (W_UK.view(Spy), W_UV.view(Spy)))
    monkeypatch.setattr(layer, "W_O", layer.W_O.view(Spy))
    layer.decode_step(rng.standard_normal((1, 1, 24)), cache)
    assert seen[-2:] == [(10, 6), (18, 24)], seen  # the weighted latent through W_UV, then the merged heads through W_O
    assert (10, 24) not in seen  # no (d_c, d_model) product of the two


def test_the_absorbed_value_product_costs_more_than_w_uv_then_w_o_at_deepseek_v2_sizes():
    """The exercise on absorbing W_UV: h d_c d_model numbers against d_c h d_k + h d_k d_model."""
    ds = DEEPSEEK_V2
    h, d_c, d_k, d = ds.n_heads, ds.kv_latent_dim, ds.head_dim, ds.d_model
    product, apart = h * d_c * d, d_c * h * d_k + h * d_k * d
    assert (product, apart) == (335_544_320, 92_274_688)
    assert product / apart > 3.6

"""Attention layers in NumPy with hand-written backward passes.

``SelfAttention`` is the single-head layer, written with 3-D tensors and no head axis.
``GroupedQueryAttention`` is the general layer: ``num_heads`` query heads share
``num_kv_heads`` key/value heads. ``MultiHeadAttention`` is its special case
``num_kv_heads == num_heads``, and MQA is ``num_kv_heads == 1``.

Weights follow ``y = X @ W + b``: a projection matrix has shape (in_features, out_features).
"""

from __future__ import annotations

import numpy as np

from mha_lab.cpu.functional import (
    check_rank,
    merge_heads,
    scaled_dot_product_attention,
    scaled_dot_product_attention_backward,
    split_heads,
)

__all__ = ["AttentionLayer", "SelfAttention", "MultiHeadAttention", "GroupedQueryAttention"]


def xavier_normal(rng: np.random.Generator, fan_in: int, fan_out: int, dtype: np.dtype) -> np.ndarray:
    r"""Xavier/Glorot normal init.

    .. math:: W \sim \mathcal{N}(0, \sigma^2), \quad \sigma = \sqrt{2 / (n_{in} + n_{out})}
    """
    return rng.normal(0.0, np.sqrt(2.0 / (fan_in + fan_out)), size=(fan_in, fan_out)).astype(dtype)


class AttentionLayer:
    """What every NumPy attention layer shares: the Q, K, V, O projections (Xavier weights, optional zero
    biases, gradient slots), the input check, and the forward's cache for the backward.

    Public interface for code that builds on a layer: ``check_input``, ``project`` and
    ``project_backward``, ``clear_cache``, ``parameters`` and ``gradients``.
    """

    _names: tuple[str, ...] = ("Q", "K", "V", "O")

    def _init_params(self, shapes: dict[str, tuple[int, int]], use_bias: bool, seed: int | None, dtype) -> None:
        rng = np.random.default_rng(seed)
        self.use_bias = use_bias
        self.dtype = np.dtype(dtype)
        for n in self._names:
            fan_in, fan_out = shapes[n]
            setattr(self, f"W_{n}", xavier_normal(rng, fan_in, fan_out, self.dtype))
            if use_bias:
                setattr(self, f"b_{n}", np.zeros(fan_out, dtype=self.dtype))
        self.clear_cache()

    def parameters(self) -> dict[str, np.ndarray]:
        """The trainable arrays by name: W_Q, W_K, W_V, W_O and, with bias, b_Q ... b_O."""
        names = [f"W_{n}" for n in self._names]
        if self.use_bias:
            names += [f"b_{n}" for n in self._names]
        return {n: getattr(self, n) for n in names}

    def gradients(self) -> dict[str, np.ndarray]:
        """The gradients of the last backward, keyed like ``parameters()``."""
        return {n: getattr(self, f"grad_{n}") for n in self.parameters()}

    def project(self, X: np.ndarray, n: str) -> np.ndarray:
        """Projection ``n`` ("Q", "K", "V" or "O"): X @ W_n + b_n, (..., in_features) -> (..., out_features)."""
        y = X @ getattr(self, f"W_{n}")
        if self.use_bias:
            y += getattr(self, f"b_{n}")
        return y

    def project_backward(self, X: np.ndarray, grad_y: np.ndarray, n: str) -> np.ndarray:
        """Store grad_W_n = X^T grad_y (summed over B, L) and grad_b_n; return grad_X = grad_y W_n^T."""
        W = getattr(self, f"W_{n}")
        setattr(self, f"grad_W_{n}", X.reshape(-1, X.shape[-1]).T @ grad_y.reshape(-1, grad_y.shape[-1]))
        if self.use_bias:
            setattr(self, f"grad_b_{n}", grad_y.sum(axis=(0, 1)))
        return grad_y @ W.T

    def check_input(self, X: np.ndarray) -> np.ndarray:
        """``X`` as an array of the layer's dtype, after checking its shape is (B, L, d_model)."""
        check_rank("X", X, 3, "(B, L, d_model)")
        if X.shape[-1] != self.d_model:
            raise ValueError(f"X has d_model={X.shape[-1]} but the layer expects d_model={self.d_model}")
        return np.asarray(X, dtype=self.dtype)

    def clear_cache(self) -> None:
        """Drop what the last forward kept for the backward (its (B, h, L, L) weights included)."""
        self._cache: dict | None = None
        self.attention_weights: np.ndarray | None = None

    def _cached(self) -> dict:
        if self._cache is None:
            raise RuntimeError("backward() called before forward(): nothing is cached")
        return self._cache


class SelfAttention(AttentionLayer):
    r"""Single-head self-attention on (B, L, d_model) inputs, with no head axis at all.

    .. math:: \mathrm{out} = \mathrm{softmax}\Big(\frac{(XW_Q)(XW_K)^\top}{\sqrt{d_k}} + M\Big)(XW_V)\,W_O

    Shapes: W_Q, W_K: (d_model, d_k); W_V: (d_model, d_v); W_O: (d_v, d_out).
    """

    def __init__(self, d_model: int, d_k: int, d_v: int, d_out: int, use_bias: bool = False,
                 seed: int | None = None, dtype=np.float64) -> None:
        self.d_model, self.d_k, self.d_v, self.d_out = d_model, d_k, d_v, d_out
        shapes = {"Q": (d_model, d_k), "K": (d_model, d_k), "V": (d_model, d_v), "O": (d_v, d_out)}
        self._init_params(shapes, use_bias, seed, dtype)

    def forward(self, X: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        """(B, L, d_model) -> (B, L, d_out); ``mask`` is additive, broadcastable to (B, L, L)."""
        X = self.check_input(X)
        Q, K, V = (self.project(X, n) for n in "QKV")  # (B, L, d_k), (B, L, d_k), (B, L, d_v)
        if mask is not None and mask.ndim == 4 and mask.shape[:2] == (1, 1):
            mask = mask[0, 0]  # (1, 1, L, L) -> (L, L): there is no head axis here
        Z, A = scaled_dot_product_attention(Q, K, V, mask)  # (B, L, d_v), (B, L, L)
        self.attention_weights = A
        self._cache = {"X": X, "Q": Q, "K": K, "V": V, "A": A, "Z": Z}
        return self.project(Z, "O")

    def backward(self, grad_out: np.ndarray) -> np.ndarray:
        """Store grad_W_* (and grad_b_*) and return dL/dX of shape (B, L, d_model)."""
        c = self._cached()
        grad_Z = self.project_backward(c["Z"], grad_out, "O")  # (B, L, d_v)
        grad_Q, grad_K, grad_V = scaled_dot_product_attention_backward(grad_Z, c["Q"], c["K"], c["V"], c["A"])
        return sum(self.project_backward(c["X"], g, n) for g, n in ((grad_Q, "Q"), (grad_K, "K"), (grad_V, "V")))


class GroupedQueryAttention(AttentionLayer):
    r"""Grouped-query attention: ``num_heads`` query heads share ``num_kv_heads`` K/V heads.

    Query head ``i`` reads K/V head ``i // (num_heads // num_kv_heads)``.
    ``num_kv_heads == num_heads`` is multi-head attention; ``num_kv_heads == 1`` is MQA.

    .. math:: \mathrm{head}_i = \mathrm{softmax}\Big(\frac{Q_i K_{g(i)}^\top}{\sqrt{d_k}} + M\Big) V_{g(i)},
              \qquad \mathrm{out} = [\mathrm{head}_1, \dots, \mathrm{head}_h]\, W_O

    Shapes: W_Q, W_O: (d_model, d_model); W_K, W_V: (d_model, num_kv_heads * d_k);
    d_k = d_model // num_heads.
    """

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, use_bias: bool = False,
                 seed: int | None = None, dtype=np.float64) -> None:
        if num_heads < 1 or num_kv_heads < 1:
            raise ValueError(f"num_heads and num_kv_heads must be positive, got {num_heads} and {num_kv_heads}")
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}")
        self.d_model, self.num_heads, self.num_kv_heads = d_model, num_heads, num_kv_heads
        self.d_k = d_model // num_heads
        self.n_rep = num_heads // num_kv_heads  # query heads per K/V head
        d_kv = num_kv_heads * self.d_k
        shapes = {"Q": (d_model, d_model), "K": (d_model, d_kv), "V": (d_model, d_kv), "O": (d_model, d_model)}
        self._init_params(shapes, use_bias, seed, dtype)

    def forward(self, X: np.ndarray, mask: np.ndarray | None = None, *, X_kv: np.ndarray | None = None) -> np.ndarray:
        """(B, L_q, d_model) -> (B, L_q, d_model); ``mask`` is additive, broadcastable to (B, h, L_q, L_k).

        Self-attention by default. With ``X_kv`` (B, L_k, d_model) it is cross-attention: queries come
        from ``X``, keys and values from ``X_kv``, and L_k may differ from L_q. A key-padding mask
        for it has shape (B, 1, 1, L_k).
        """
        X = self.check_input(X)
        cross = X_kv is not None
        X_kv = self._check_kv_input(X_kv, X) if cross else X
        # 1. project: three fused GEMMs, each split into heads
        Q, K, V = self.project_qkv(X, X_kv)  # (B, h, L_q, d_k), (B, h_kv, L_k, d_k), (B, h_kv, L_k, d_k)
        # 2.-5. scores, mask, softmax, weighted values: each K/V head meets its group of query heads at once
        Z, A = scaled_dot_product_attention(Q, K, V, mask, enable_gqa=True)  # (B, h, L_q, d_k), (B, h, L_q, L_k)
        # 6. merge heads
        concat = merge_heads(Z)  # (B, h, L_q, d_k) -> (B, L_q, d_model)
        # 7. output projection
        out = self.project(concat, "O")
        self.attention_weights = A
        # K, V: h_kv heads
        self._cache = {"X": X, "Q": Q, "K": K, "V": V, "A": A, "concat": concat}
        if cross:  # self-attention caches X once
            self._cache["X_kv"] = X_kv
        return out

    def _check_kv_input(self, X_kv: np.ndarray, X: np.ndarray) -> np.ndarray:
        """``X_kv`` checked like ``X`` and against it: the two must share the batch size."""
        X_kv = self.check_input(X_kv)
        if X_kv.shape[0] != X.shape[0]:
            raise ValueError(f"X_kv has batch size {X_kv.shape[0]} but X has {X.shape[0]}")
        return X_kv

    def project_qkv(self, X: np.ndarray, X_kv: np.ndarray | None = None, *,
                    offset: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Queries, keys and values split into heads: step 1 of ``forward``, for code that supplies its own core.

        Keys and values come from ``X_kv`` when given (cross-attention), else from ``X``.
        ``offset``, the absolute position of X's first token, is accepted and unused: these
        projections do not depend on position (a layer whose projections do, like
        ``RotaryAttention``, reads it), so a decoder passes it to any layer alike.
        Shapes: X: (B, L_q, d_model), X_kv: (B, L_k, d_model) -> Q: (B, h, L_q, d_k); K, V: (B, h_kv, L_k, d_k).
        """
        X = self.check_input(X)
        X_kv = X if X_kv is None else self._check_kv_input(X_kv, X)
        Q = split_heads(self.project(X, "Q"), self.num_heads)  # (B, L_q, d_model) -> (B, h, L_q, d_k)
        K = split_heads(self.project(X_kv, "K"), self.num_kv_heads)  # (B, L_k, h_kv*d_k) -> (B, h_kv, L_k, d_k)
        V = split_heads(self.project(X_kv, "V"), self.num_kv_heads)  # (B, L_k, h_kv*d_k) -> (B, h_kv, L_k, d_k)
        return Q, K, V

    def project_out(self, Z: np.ndarray) -> np.ndarray:
        """Merge the heads and apply the output projection (steps 6 and 7): (B, h, L, d_k) -> (B, L, d_model)."""
        return self.project(merge_heads(Z), "O")  # (B, h, L, d_k) -> (B, L, d_model) -> (B, L, d_model)

    @property
    def head_attention_weights(self) -> list[np.ndarray]:
        """The last forward's attention as a list of h matrices of shape (B, L, L), for plotting."""
        return [self.attention_weights[:, i] for i in range(self.num_heads)]

    def backward(self, grad_out: np.ndarray
                 ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """The seven steps of the chain rule, in reverse order of the forward.

        Stores grad_W_Q, grad_W_K, grad_W_V, grad_W_O (and grad_b_* with bias).
        After self-attention it returns dL/dX of shape (B, L, d_model), the sum of
        the Q, K and V branches. After cross-attention it returns the pair
        (dL/dX, dL/dX_kv), of shapes (B, L_q, d_model) and (B, L_k, d_model):
        the Q branch reaches X, the K and V branches reach X_kv.
        """
        c = self._cached()
        if grad_out.shape != c["X"].shape:
            raise ValueError(f"grad_out has shape {grad_out.shape}, "
                             f"expected {c['X'].shape}")
        # step 1: output projection -> grad_W_O, grad_concat
        # (B, L_q, d_model)
        grad_concat = self.project_backward(c["concat"], grad_out, "O")
        # step 2: head merge -> (B, L_q, d_model) -> (B, h, L_q, d_k)
        grad_Z = split_heads(grad_concat, self.num_heads)
        # steps 3-5: Z = A V, softmax, S = Q K^T / sqrt(d_k) -> grad_Q, grad_K, grad_V
        grad_Q, grad_K, grad_V = scaled_dot_product_attention_backward(
            grad_Z, c["Q"], c["K"], c["V"], c["A"])
        # step 6: head split -> (B, h, L, d_k) -> (B, L, h*d_k)
        grads = {"Q": merge_heads(grad_Q), "K": merge_heads(grad_K),
                 "V": merge_heads(grad_V)}
        # step 7: projections -> grad_W_Q/K/V; X fed Q, X_kv fed K and V
        # (in self-attention X_kv is X, and its gradient is the sum of all three)
        X, X_kv = c["X"], c.get("X_kv", c["X"])
        grad_X = self.project_backward(X, grads["Q"], "Q")
        grad_K_in = self.project_backward(X_kv, grads["K"], "K")
        grad_V_in = self.project_backward(X_kv, grads["V"], "V")
        if "X_kv" not in c:
            return grad_X + grad_K_in + grad_V_in
        return grad_X, grad_K_in + grad_V_in


class MultiHeadAttention(GroupedQueryAttention):
    r"""Multi-head attention with fused projections: every head has its own K and V.

    .. math:: \mathrm{MultiHead}(X) = \mathrm{Concat}(\mathrm{head}_0, \dots, \mathrm{head}_{h-1})\, W_O,
              \quad \mathrm{head}_i = \mathrm{softmax}\Big(\frac{Q_i K_i^\top}{\sqrt{d_k}} + M\Big) V_i

    Columns ``i*d_k:(i+1)*d_k`` of W_Q, W_K, W_V are head i's projections;
    rows ``i*d_k:(i+1)*d_k`` of W_O read head i's output.
    Shapes: X: (B, L, d_model) -> out: (B, L, d_model); attention_weights: (B, h, L, L).
    """

    def __init__(self, d_model: int, num_heads: int, use_bias: bool = False, seed: int | None = None,
                 dtype=np.float64) -> None:
        super().__init__(d_model, num_heads, num_heads, use_bias=use_bias, seed=seed, dtype=dtype)

r"""A one-layer decoder with random weights, run over a paged cache: the model a serving loop drives.

Its logits for token :math:`t_p` at position p:

.. math:: x_p = E[t_p] + P_p, \qquad y = x + \mathrm{Attn}(x), \qquad
          \mathrm{logits}_p = y_p E^\top / \sqrt{d}

(causal grouped-query attention, the embedding tied to the unembedding). ``forward`` runs whole
sequences with a causal mask, the plain counterpart; ``step`` runs one engine step: for each
sequence its new tokens (a prefill chunk, one decoding token, or a draft to verify), packed
into one batch for the projections, each attending through its own block table.
"""

from __future__ import annotations

import numpy as np

from mha_lab.cpu.attention import GroupedQueryAttention
from mha_lab.cpu.functional import create_causal_mask, scaled_dot_product_attention
from mha_lab.cpu.paged import PagedKVCache

__all__ = ["TinyLM"]


class TinyLM:
    """Token and position embeddings, one causal GQA layer with a residual, tied unembedding (random weights)."""

    def __init__(self, vocab: int = 64, d_model: int = 32, num_heads: int = 4, num_kv_heads: int = 2,
                 max_len: int = 1024, seed: int = 0) -> None:
        if vocab < 2 or max_len < 1:
            raise ValueError(f"vocab must be at least 2 and max_len at least 1, got {vocab} and {max_len}")
        rng = np.random.default_rng(seed)
        self.vocab, self.max_len, self.d_model = vocab, max_len, d_model
        self.layer = GroupedQueryAttention(d_model, num_heads, num_kv_heads, seed=seed + 1)
        self.E = rng.standard_normal((vocab, d_model))  # (V, d)
        self.P = rng.standard_normal((max_len, d_model))  # (max_len, d)

    def perturbed(self, noise: float, seed: int = 1) -> TinyLM:
        """A copy whose every weight gets Gaussian noise of ``noise`` times its own spread: a stand-in draft."""
        rng = np.random.default_rng(seed)
        other = TinyLM(self.vocab, self.d_model, self.layer.num_heads, self.layer.num_kv_heads, self.max_len)
        for name, w in self.layer.parameters().items():
            getattr(other.layer, name)[...] = w + noise * w.std() * rng.standard_normal(w.shape)
        other.E, other.P = (w + noise * w.std() * rng.standard_normal(w.shape) for w in (self.E, self.P))
        return other

    def _embed(self, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab):
            raise ValueError(f"token ids must lie in [0, {self.vocab}), got {tokens.min()}..{tokens.max()}")
        if positions.size and positions.max() >= self.max_len:
            raise ValueError(f"position {positions.max()} is past the model's max_len={self.max_len}")
        return self.E[tokens] + self.P[positions]

    def _logits(self, Y: np.ndarray) -> np.ndarray:
        """The tied unembedding: Y (..., d) -> (..., V)."""
        return Y @ self.E.T / np.sqrt(self.d_model)

    def forward(self, tokens: np.ndarray) -> np.ndarray:
        """Logits of whole sequences, causally: tokens (B, L) -> (B, L, V)."""
        tokens = np.asarray(tokens)
        X = self._embed(tokens, np.arange(tokens.shape[1]))  # (B, L, d)
        return self._logits(X + self.layer.forward(X, create_causal_mask(tokens.shape[1])))

    def step(self, cache: PagedKVCache, work: dict[int, list[int]]) -> dict[int, np.ndarray]:
        """One engine step: ``work[s]`` are sequence s's new tokens; returns their logits (n_s, V) per sequence.

        The new tokens of all sequences go through the projections as one packed batch of
        sum(n_s) rows; each sequence appends its keys and values to ``cache`` and its queries
        attend through its block table, query i of s at position ``cache.lengths[s] + i``.
        """
        seqs = [s for s in work if len(work[s])]
        starts = {s: cache.lengths[s] for s in seqs}
        tokens = np.concatenate([np.asarray(work[s], dtype=np.int64) for s in seqs])
        positions = np.concatenate([starts[s] + np.arange(len(work[s])) for s in seqs])
        X = self._embed(tokens, positions)[None]  # (1, T, d): every new token of the step
        Q, K, V = self.layer.project_qkv(X)  # (1, h, T, d_k), (1, h_kv, T, d_k) twice
        Z, row = np.empty_like(Q), 0
        for s in seqs:
            n = len(work[s])
            cache.append(s, K[0, :, row:row + n], V[0, :, row:row + n])
            K_s, V_s = cache.gather(s)  # (h_kv, start + n, d_k)
            mask = create_causal_mask(n, key_len=starts[s] + n)  # (1, 1, n, start + n)
            Z[:, :, row:row + n], _ = scaled_dot_product_attention(Q[:, :, row:row + n], K_s[None], V_s[None],
                                                                   mask, enable_gqa=True)
            row += n
        logits = self._logits(X + self.layer.project_out(Z))[0]  # (1, T, d) -> (T, V)
        bounds = np.cumsum([0] + [len(work[s]) for s in seqs])
        return {s: logits[a:b] for s, a, b in zip(seqs, bounds[:-1], bounds[1:], strict=True)}

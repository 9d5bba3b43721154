r"""Tensor parallelism over heads (Megatron-LM), simulated in NumPy on N pretend devices.

Device r owns a contiguous block of query heads. W_Q, W_K, W_V are split by columns
(column-parallel: each device projects X to its own heads only), W_O by rows (row-parallel:
each device multiplies its heads' outputs by the matching rows). Every device then holds a
partial output of full shape (B, L, d_model); one all-reduce (a sum) gives the layer's output.

.. math:: \mathrm{out} = b_O + \sum_{r=0}^{N-1} \mathrm{Concat}(\mathrm{head}_i)_{i \in r}\, W_O^{(r)}

With grouped-query attention the key/value heads are split too. When the devices
outnumber the K/V heads, each K/V head is replicated on the devices whose query heads read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mha_lab.cpu.attention import GroupedQueryAttention
from mha_lab.cpu.functional import merge_heads, repeat_kv, scaled_dot_product_attention, split_heads
from mha_lab.parallel.heads import check_split, head_columns, rank_heads

__all__ = ["Shard", "shard_layer", "shard_forward", "all_reduce", "tensor_parallel_forward"]


@dataclass(frozen=True)
class Shard:
    """One device's slice of an attention layer.

    Shapes: W_Q: (d_model, h_r * d_k); W_K, W_V: (d_model, g_r * d_k); W_O: (h_r * d_k, d_model),
    where h_r query heads and g_r key/value heads live on this device.
    """

    rank: int
    q_heads: range
    kv_heads: range
    d_k: int
    W_Q: np.ndarray
    W_K: np.ndarray
    W_V: np.ndarray
    W_O: np.ndarray
    b_Q: np.ndarray | None = None  # noqa: N815 (the layer's attribute names)
    b_K: np.ndarray | None = None  # noqa: N815 (the layer's attribute names)
    b_V: np.ndarray | None = None  # noqa: N815 (the layer's attribute names)


def shard_layer(layer: GroupedQueryAttention, world_size: int) -> list[Shard]:
    """Split a MultiHeadAttention or GroupedQueryAttention layer's weights across ``world_size`` devices.

    Needs ``num_heads % world_size == 0``, and either ``num_kv_heads % world_size == 0`` (K/V heads
    split) or ``world_size % num_kv_heads == 0`` (each K/V head replicated on several devices).
    The shards are views of the layer's arrays: no weight is copied.
    """
    h, h_kv = layer.num_heads, layer.num_kv_heads
    check_split(h, h_kv, world_size)
    d_k = layer.d_model // h
    shards = []
    for r in range(world_size):
        q_heads, kv_heads = rank_heads(h, h_kv, world_size, r)
        q, kv = head_columns(q_heads, d_k), head_columns(kv_heads, d_k)
        bias = {f"b_{n}": getattr(layer, f"b_{n}")[s] for n, s in (("Q", q), ("K", kv), ("V", kv))} \
            if layer.use_bias else {}
        shards.append(Shard(r, q_heads, kv_heads, d_k,
                            W_Q=layer.W_Q[:, q], W_K=layer.W_K[:, kv], W_V=layer.W_V[:, kv],
                            W_O=layer.W_O[q, :], **bias))  # column-parallel Q/K/V, row-parallel W_O
    return shards


def shard_forward(X: np.ndarray, shard: Shard,
                  mask: np.ndarray | None = None) -> np.ndarray:
    """One device's partial output: its heads' attention times its rows of W_O
    (no bias, no communication).

    Shapes: X: (B, L, d_model), replicated on every device -> (B, L, d_model).
    """
    h_r, g_r = len(shard.q_heads), len(shard.kv_heads)
    pairs = ((shard.W_Q, shard.b_Q), (shard.W_K, shard.b_K), (shard.W_V, shard.b_V))
    # (B, L, d_model) -> (B, L, heads * d_k) for each of Q, K, V
    Q, K, V = (X @ W + (0 if b is None else b) for W, b in pairs)
    Q = split_heads(Q, h_r)  # (B, L, h_r*d_k) -> (B, h_r, L, d_k)
    # (B, L, g_r*d_k) -> (B, g_r, L, d_k)
    K, V = split_heads(K, g_r), split_heads(V, g_r)
    K, V = repeat_kv(K, h_r // g_r), repeat_kv(V, h_r // g_r)  # -> (B, h_r, L, d_k)
    Z, _ = scaled_dot_product_attention(Q, K, V, mask)  # (B, h_r, L, d_k)
    # (B, h_r, L, d_k) -> (B, L, h_r*d_k) @ (h_r*d_k, d_model)
    return merge_heads(Z) @ shard.W_O


def all_reduce(partials: list[np.ndarray]) -> np.ndarray:
    """The collective that ends the layer: every device receives the sum of all partial outputs."""
    if not partials:
        raise ValueError("all_reduce needs at least one partial result")
    return np.sum(partials, axis=0)


def tensor_parallel_forward(X: np.ndarray, layer: GroupedQueryAttention,
                            world_size: int,
                            mask: np.ndarray | None = None) -> np.ndarray:
    """The layer's forward split over ``world_size`` simulated devices; equals
    ``layer.forward(X, mask)``.

    Shapes: X: (B, L, d_model) -> (B, L, d_model). ``mask`` is additive,
    broadcastable to (B, h, L, L).
    """
    X = layer.check_input(X)
    shards = shard_layer(layer, world_size)
    out = all_reduce([shard_forward(X, s, mask) for s in shards])
    if layer.use_bias:
        out += layer.b_O  # added once, after the reduction, not on every device
    return out

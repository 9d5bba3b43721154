"""What parallelism costs each device: weights held, bytes sent (all-reduces, the ring, Ulysses' all-to-alls)."""

from __future__ import annotations

from mha_lab.analysis import DType, dtype_bytes
from mha_lab.parallel.heads import check_split

__all__ = ["weights_per_device", "allreduce_bytes", "kv_grad_allreduce_bytes", "ring_bytes", "ulysses_bytes"]


def weights_per_device(d_model: int, n_heads: int, n_kv_heads: int, world_size: int) -> int:
    r"""Attention weight elements one device holds: :math:`(2d^2 + 2d\,g\,d_k)/N`, K/V at least one head.

    W_Q and W_O shrink as 1/N; W_K and W_V shrink until each device holds a single K/V head,
    after which they are replicated.
    """
    check_split(n_heads, n_kv_heads, world_size)
    d_k = d_model // n_heads
    kv_local = max(n_kv_heads // world_size, 1)
    return 2 * d_model * d_model // world_size + 2 * d_model * kv_local * d_k


def allreduce_bytes(batch_size: int, seq_len: int, d_model: int, world_size: int,
                    dtype: DType = "bfloat16") -> dict[str, float]:
    r"""Communication of the one forward all-reduce of an attention layer.

    ``message``: the (B, L, d_model) partial output, :math:`BLd` elements;
    ``ring_per_device``: what each device sends in a ring all-reduce, :math:`2\frac{N-1}{N}BLd` elements
    (reduce-scatter then all-gather); both in bytes. The backward pass has one more all-reduce of the same size.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    message = batch_size * seq_len * d_model * dtype_bytes(dtype)
    return {"message": message, "ring_per_device": 2 * (world_size - 1) / world_size * message}


def kv_grad_allreduce_bytes(d_model: int, n_heads: int, n_kv_heads: int, world_size: int, use_bias: bool,
                            dtype: DType = "bfloat16") -> int:
    r"""Bytes per device of the backward all-reduces that sum a replicated key/value head's weight gradients.

    Zero when the key/value heads are split (:math:`h_{kv} \ge N`); otherwise each device holds one
    key/value head, and its gradients of W_K and W_V (:math:`2 d_\text{model} d_k` elements, plus
    :math:`2 d_k` for b_K, b_V) are summed over the devices that share it.
    """
    check_split(n_heads, n_kv_heads, world_size)
    if n_kv_heads >= world_size:
        return 0
    d_k = d_model // n_heads
    return (2 * d_model * d_k + (2 * d_k if use_bias else 0)) * dtype_bytes(dtype)


def _check_cp(world_size: int, seq_len: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if seq_len % world_size:
        raise ValueError(f"seq_len={seq_len} does not split into {world_size} equal blocks")


def ring_bytes(batch_size: int, seq_len: int, n_kv_heads: int, d_k: int, world_size: int,
               dtype: DType = "bfloat16") -> dict[str, int]:
    r"""Bytes one rank sends in ring attention, per attention call: forward, and backward.

    A key/value block is :math:`2 B h_{kv} (L/N) d_k` elements (K and V). Forward, each rank passes
    a block on N-1 times; backward, N-1 times again, and the gradients :math:`\nabla_K, \nabla_V`
    of a block travel once round the whole ring back to their owner, N times. Zigzag or not, the
    blocks are whole.
    """
    _check_cp(world_size, seq_len)
    block = 2 * batch_size * n_kv_heads * (seq_len // world_size) * d_k * dtype_bytes(dtype)
    return {"K/V forward": (world_size - 1) * block, "K/V backward": (world_size - 1) * block,
            "dK/dV backward": world_size * block if world_size > 1 else 0}


def ulysses_bytes(batch_size: int, seq_len: int, n_heads: int, n_kv_heads: int, d_k: int, world_size: int,
                  dtype: DType = "bfloat16") -> dict[str, int]:
    r"""Bytes one rank sends to the others in DeepSpeed-Ulysses' all-to-alls, per attention call.

    Forward: Q, K, V go from sequence-sharded to head-sharded and the output back; each all-to-all
    keeps :math:`1/N` of a rank's :math:`B (L/N) \cdot \text{heads} \cdot d_k` elements and sends the
    rest: :math:`\frac{N-1}{N} B \frac{L}{N} d_k (2h + 2h_{kv})` elements. Backward moves the same
    tensors' gradients the other way, the same bytes.
    """
    _check_cp(world_size, seq_len)
    heads = 2 * n_heads + 2 * n_kv_heads
    sent = batch_size * (seq_len // world_size) * d_k * heads * (world_size - 1) // world_size
    return {"all-to-all forward": sent * dtype_bytes(dtype), "all-to-all backward": sent * dtype_bytes(dtype)}

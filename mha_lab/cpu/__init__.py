"""NumPy reference implementation of multi-head attention (float64 by default)."""

from mha_lab.cpu.attention import GroupedQueryAttention, MultiHeadAttention, SelfAttention
from mha_lab.cpu.decode import KVCache, decode_step, prefill
from mha_lab.cpu.functional import (
    create_causal_mask,
    merge_heads,
    repeat_kv,
    scaled_dot_product_attention,
    scaled_dot_product_attention_backward,
    softmax,
    softmax_backward,
    split_heads,
)
from mha_lab.cpu.latent import LatentAttention, LatentCache
from mha_lab.cpu.memory import (
    Checkpointed,
    ChunkedLayer,
    chunked_attention,
    chunked_attention_backward,
    chunked_forward,
    default_score_bound,
    head_by_head_forward,
)
from mha_lab.cpu.per_head import per_head_attention
from mha_lab.cpu.positions import (
    LearnedPositions,
    RotaryAttention,
    alibi_bias,
    alibi_slopes,
    apply_rope,
    interleaved_to_half,
    rotation_matrix,
    sinusoidal_encoding,
)

__all__ = [
    "softmax", "softmax_backward", "create_causal_mask", "split_heads", "merge_heads", "repeat_kv",
    "scaled_dot_product_attention", "scaled_dot_product_attention_backward",
    "SelfAttention", "MultiHeadAttention", "GroupedQueryAttention",
    "per_head_attention", "head_by_head_forward", "chunked_forward", "chunked_attention", "chunked_attention_backward",
    "default_score_bound", "ChunkedLayer", "Checkpointed", "KVCache", "prefill", "decode_step",
    "sinusoidal_encoding", "LearnedPositions", "apply_rope", "rotation_matrix", "interleaved_to_half",
    "RotaryAttention", "alibi_slopes", "alibi_bias", "LatentAttention", "LatentCache",
]

"""Tensor parallelism over heads (Megatron-LM) and context parallelism over the sequence: NumPy, then the real thing.

- ``heads``: which query and key/value heads each of N devices holds (shared by everything below);
- ``simulation``: N pretend devices in NumPy, the all-reduce a plain sum (what the tensor-parallel chapter reads first);
- ``cost``: weights per device and bytes per all-reduce, from the shapes;
- ``layer``: ``TensorParallelAttention``, an ``nn.Module`` on a ``torch.distributed`` process group,
  with Megatron's ``f`` and ``g`` as autograd Functions;
- ``launch``: start N ranks on this machine, or join ``torchrun``'s;
- ``check``: ``python -m mha_lab tp``, the layer on real ranks against one device;
- ``sequence``: the sequence split over N pretend ranks (contiguous, zigzag) and ring attention in NumPy;
- ``context``: ring attention and DeepSpeed-Ulysses on a ``torch.distributed`` group, forward and backward;
- ``context_check``: ``python -m mha_lab cp``, both on real ranks against one device;
- ``scaling``: a step of either on 1, 2, 4... ranks, timed (``make bench``).

This package imports only the NumPy parts; ``layer``, ``launch``, ``check``, ``context``,
``context_check`` and ``scaling`` need PyTorch and are imported by name
(``from mha_lab.parallel.layer import TensorParallelAttention``).
"""

from mha_lab.parallel.cost import (
    allreduce_bytes,
    kv_grad_allreduce_bytes,
    ring_bytes,
    ulysses_bytes,
    weights_per_device,
)
from mha_lab.parallel.heads import check_split, head_columns, rank_heads, replica_groups
from mha_lab.parallel.sequence import (
    block_state,
    merge_states,
    rank_partials,
    ring_attention,
    ring_part,
    ring_source,
    shard_sequence,
    unshard_sequence,
    zigzag_chunks,
)
from mha_lab.parallel.simulation import Shard, all_reduce, shard_forward, shard_layer, tensor_parallel_forward

__all__ = [
    "Shard", "check_split", "rank_heads", "head_columns", "replica_groups", "shard_layer", "weights_per_device",
    "shard_forward", "all_reduce", "tensor_parallel_forward", "allreduce_bytes", "kv_grad_allreduce_bytes",
    "ring_bytes", "ulysses_bytes", "zigzag_chunks", "shard_sequence", "unshard_sequence", "ring_source", "ring_part",
    "block_state", "merge_states", "rank_partials", "ring_attention",
]

"""Tensor parallelism over heads: the simulated N-device layer equals the single-device layer."""

import numpy as np
import pytest

from mha_lab.cpu import GroupedQueryAttention, MultiHeadAttention, create_causal_mask
from mha_lab.parallel import (
    all_reduce,
    allreduce_bytes,
    shard_forward,
    shard_layer,
    tensor_parallel_forward,
    weights_per_device,
)
from mha_lab.testing import assert_close


def _x(B, L, d, seed=0):
    return np.random.default_rng(seed).normal(size=(B, L, d))


@pytest.mark.parametrize("world_size", [1, 2, 3, 6])
@pytest.mark.parametrize("use_bias", [False, True])
def test_mha_tensor_parallel_equals_single_device(world_size, use_bias):
    layer = MultiHeadAttention(d_model=24, num_heads=6, use_bias=use_bias, seed=1)
    if use_bias:  # nonzero biases, so that adding b_O on every device would be caught
        for n in "QKVO":
            setattr(layer, f"b_{n}", np.random.default_rng(ord(n)).normal(size=24))
    X = _x(3, 7, 24)
    assert_close(tensor_parallel_forward(X, layer, world_size), layer.forward(X))


@pytest.mark.parametrize("num_kv_heads,world_size", [(4, 2), (4, 4), (2, 4), (1, 4), (2, 2), (1, 1)])
def test_gqa_tensor_parallel_equals_single_device(num_kv_heads, world_size):
    layer = GroupedQueryAttention(d_model=32, num_heads=8, num_kv_heads=num_kv_heads, seed=2)
    X = _x(2, 97, 32, seed=3)
    mask = create_causal_mask(97)
    assert_close(tensor_parallel_forward(X, layer, world_size, mask), layer.forward(X, mask))


def test_gqa_kv_heads_are_split_when_they_divide():
    layer = GroupedQueryAttention(d_model=32, num_heads=8, num_kv_heads=4, seed=0)
    shards = shard_layer(layer, 2)
    assert [list(s.kv_heads) for s in shards] == [[0, 1], [2, 3]]
    assert [s.W_K.shape for s in shards] == [(32, 8), (32, 8)]


def test_mqa_kv_head_is_replicated_on_every_device():
    layer = GroupedQueryAttention(d_model=32, num_heads=8, num_kv_heads=1, seed=0)
    shards = shard_layer(layer, 4)
    assert all(list(s.kv_heads) == [0] for s in shards)
    for s in shards:
        np.testing.assert_array_equal(s.W_K, layer.W_K)


def test_shards_tile_the_weights_column_and_row_wise():
    layer = MultiHeadAttention(d_model=16, num_heads=4, seed=0)
    shards = shard_layer(layer, 2)
    assert [s.W_Q.shape for s in shards] == [(16, 8), (16, 8)]
    assert [s.W_O.shape for s in shards] == [(8, 16), (8, 16)]
    np.testing.assert_array_equal(np.concatenate([s.W_Q for s in shards], axis=1), layer.W_Q)
    np.testing.assert_array_equal(np.concatenate([s.W_O for s in shards], axis=0), layer.W_O)
    assert all(np.shares_memory(s.W_V, layer.W_V) for s in shards)  # views, not copies


def test_one_partial_is_not_the_answer():
    """Each device alone has only part of the output: the all-reduce is needed."""
    layer = MultiHeadAttention(d_model=16, num_heads=4, seed=0)
    X = _x(1, 5, 16)
    partials = [shard_forward(X, s) for s in shard_layer(layer, 2)]
    full = layer.forward(X)
    assert not np.allclose(partials[0], full)
    assert_close(all_reduce(partials), full)


def test_heads_not_divisible_by_devices_is_an_error():
    layer = MultiHeadAttention(d_model=24, num_heads=6, seed=0)
    with pytest.raises(ValueError, match="num_heads=6 is not divisible by world_size=4"):
        tensor_parallel_forward(_x(1, 3, 24), layer, 4)


def test_kv_heads_and_devices_that_do_not_divide_are_an_error():
    layer = GroupedQueryAttention(d_model=48, num_heads=12, num_kv_heads=4, seed=0)
    with pytest.raises(ValueError, match="num_kv_heads=4 and world_size=6"):
        shard_layer(layer, 6)


def test_bad_world_size_and_empty_reduce():
    layer = MultiHeadAttention(d_model=8, num_heads=2, seed=0)
    with pytest.raises(ValueError, match="world_size"):
        shard_layer(layer, 0)
    with pytest.raises(ValueError, match="at least one"):
        all_reduce([])


def test_allreduce_bytes_from_shapes():
    comm = allreduce_bytes(batch_size=2, seq_len=4096, d_model=8192, world_size=8, dtype="bfloat16")
    assert comm["message"] == 2 * 4096 * 8192 * 2
    assert comm["ring_per_device"] == pytest.approx(2 * 7 / 8 * comm["message"])
    assert allreduce_bytes(1, 10, 16, world_size=1)["ring_per_device"] == 0


@pytest.mark.parametrize("num_kv_heads,world_size", [(8, 1), (8, 4), (2, 4), (1, 2)])
def test_weights_per_device_matches_the_shards(num_kv_heads, world_size):
    layer = GroupedQueryAttention(d_model=32, num_heads=8, num_kv_heads=num_kv_heads, seed=0)
    shard = shard_layer(layer, world_size)[0]
    held = sum(getattr(shard, f"W_{n}").size for n in "QKVO")
    assert weights_per_device(32, 8, num_kv_heads, world_size) == held


def test_weight_split_figure_colours_every_device():
    import matplotlib

    matplotlib.use("Agg")
    from mha_lab.plots.parallel import plot_tp_memory_and_traffic, plot_weight_split

    fig = plot_weight_split(d_model=16, num_heads=4, num_kv_heads=2, world_size=4)
    assert [t.get_text() for t in fig.legends[0].get_texts()][-1] == "replicated on several devices"
    assert len(fig.axes) == 4
    bars = plot_tp_memory_and_traffic(world_sizes=(1, 2)).axes[0]
    assert bars.get_xlabel() and bars.get_ylabel()

"""Figures of tensor parallelism over heads: which device holds which weights, and what it costs to talk."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from mha_lab.analysis import MODEL_CONFIGS, DType, dtype_bytes
from mha_lab.cpu import GroupedQueryAttention
from mha_lab.parallel import allreduce_bytes, head_columns, shard_layer, weights_per_device
from mha_lab.plots.style import check, legend_outside, new_figure

__all__ = ["plot_weight_split", "plot_tp_memory_and_traffic", "plot_tp_compute_and_communication"]

_REPLICATED = -2


def _owners(shape: tuple[int, int], spans: list[tuple[int, slice]], axis: int) -> np.ndarray:
    """Device index of every element of a matrix split along ``axis``; replicated slices get _REPLICATED."""
    owner = np.full(shape, -1)
    for rank, s in spans:
        view = owner[:, s] if axis == 1 else owner[s, :]
        view[...] = np.where(view == -1, rank, _REPLICATED)
    return owner


def plot_weight_split(d_model: int = 32, num_heads: int = 8, num_kv_heads: int | None = None,
                      world_size: int = 4) -> Figure:
    """The four weight matrices of one layer, each element coloured by the device that holds it.

    W_Q, W_K, W_V are split by columns (column-parallel), W_O by rows (row-parallel). K/V heads
    shared by several devices (more devices than K/V heads) are drawn hatched grey.
    """
    g = num_kv_heads or num_heads
    layer = GroupedQueryAttention(d_model, num_heads, g, seed=0)
    shards = shard_layer(layer, world_size)
    d_k = layer.d_k
    cols = {"Q": [(s.rank, head_columns(s.q_heads, d_k)) for s in shards],
            "KV": [(s.rank, head_columns(s.kv_heads, d_k)) for s in shards]}
    panels = [("W_Q", _owners(layer.W_Q.shape, cols["Q"], 1), "column-parallel"),
              ("W_K", _owners(layer.W_K.shape, cols["KV"], 1), "column-parallel"),
              ("W_V", _owners(layer.W_V.shape, cols["KV"], 1), "column-parallel"),
              ("W_O", _owners(layer.W_O.shape, cols["Q"], 0), "row-parallel")]
    colors = plt.get_cmap("tab10").colors[:world_size]
    cmap = ListedColormap(["0.75", *colors])  # index 0: replicated, 1..N: devices
    widths = [max(p[1].shape[1], d_model // 2) for p in panels]  # room for the titles of narrow K/V panels
    fig, axes = new_figure(3.6, 1, 4, gridspec_kw={"width_ratios": widths})
    for ax, (name, owner, how) in zip(axes, panels, strict=True):
        ax.imshow(np.where(owner == _REPLICATED, 0, owner + 1), cmap=cmap, vmin=0, vmax=world_size,
                  interpolation="nearest", aspect="equal")
        if (owner == _REPLICATED).any():
            ax.contourf(owner == _REPLICATED, levels=[0.5, 1.5], colors="none", hatches=["//"])
        if (owner == _REPLICATED).all():
            how = "replicated"
        ax.set_title(f"{name} {owner.shape}\n{how}", fontsize=10)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=2, integer=True))
        ax.set_xlabel("column")
        ax.set_ylabel("row" if name == "W_Q" else "")
    handles = [Patch(color=c, label=f"device {r}") for r, c in enumerate(colors)]
    if any((p[1] == _REPLICATED).any() for p in panels):
        handles.append(Patch(facecolor="0.75", hatch="//", label="replicated on several devices"))
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 3))
    fig.suptitle(f"d_model = {d_model}, h = {num_heads}, h_kv = {g}, over {world_size} devices")
    return check(fig)


def plot_tp_memory_and_traffic(model: str = "Llama-2-70B", seq_len: int = 4096, batch_size: int = 1,
                               dtype: DType = "bfloat16", world_sizes: Sequence[int] = (1, 2, 4, 8, 16)) -> Figure:
    """Per device and per layer: attention parameters held (W_Q, W_K, W_V, W_O), and bytes sent by the forward
    all-reduce (ring), in MiB."""
    c = MODEL_CONFIGS[model]
    N = np.asarray(world_sizes)
    size = dtype_bytes(dtype)
    held = [weights_per_device(c.d_model, c.n_heads, c.n_kv_heads, int(n)) * size / 2**20 for n in N]
    sent = [allreduce_bytes(batch_size, seq_len, c.d_model, int(n), dtype)["ring_per_device"] / 2**20 for n in N]
    fig, ax = new_figure(3.8)
    x = np.arange(len(N))
    ax.bar(x - 0.2, held, width=0.4, label="attention parameters held")
    ax.bar(x + 0.2, sent, width=0.4, label=f"sent in the all-reduce\n(B = {batch_size}, L = {seq_len})")
    ax.set_xticks(x, [str(n) for n in N])
    ax.set(xlabel="devices N (tensor-parallel size)", ylabel=f"MiB per device per layer ({dtype})",
           title=f"{model}: one attention layer")
    legend_outside(ax)
    ax.grid(True, axis="y", alpha=0.3)
    return check(fig)


def plot_tp_compute_and_communication(rows: Sequence[dict]) -> Figure:
    """Per rank, one layer's forward and backward: FLOPs (left) and bytes through the all-reduces (right).

    ``rows`` are ``mha_lab.parallel.scaling.measure_scaling``'s: the bytes are what each rank
    handed to the collectives in a real run, and the dashed line is what a ring all-reduce of
    those tensors sends per rank, :math:`2\\frac{N-1}{N}` times as much.
    """
    N = [r["world_size"] for r in rows]
    x = np.arange(len(N))
    fig, (left, right) = new_figure(3.4, 1, 2)
    left.bar(x, [r["flops_per_rank"] / 1e9 for r in rows], width=0.6, color="C0")
    left.set(xlabel="ranks N", ylabel="GFLOP per rank", title="compute, forward + backward")
    handed = np.array([sum(r["bytes"].values()) / 2**10 for r in rows])
    right.bar(x, handed, width=0.6, color="C1", label="handed to the all-reduces (measured)")
    right.plot(x, [2 * (n - 1) / n * b for n, b in zip(N, handed, strict=True)], "k--o",
               label="sent by a ring all-reduce")
    right.set(xlabel="ranks N", ylabel="KiB per rank", title="communication, f and g")
    for ax in (left, right):
        ax.set_xticks(x, [str(n) for n in N])
        ax.grid(True, axis="y", alpha=0.3)
    legend_outside(right, "below", ncol=2)
    return check(fig)

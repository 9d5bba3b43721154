"""Figures and tables of what attention costs: FLOPs, memory, the KV cache, measured peak memory.

Every number is computed by ``mha_lab.analysis`` or measured here; tables come back as
Markdown strings so a chapter can display or glue them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

import numpy as np
from matplotlib.figure import Figure

from mha_lab.analysis import (
    MODEL_CONFIGS,
    DType,
    ModelConfig,
    backward_flops_breakdown,
    flops_breakdown,
    gib,
    kv_cache_bytes,
    kv_elements_per_token,
    memory_breakdown,
)
from mha_lab.cpu import (
    Checkpointed,
    ChunkedLayer,
    MultiHeadAttention,
    chunked_attention,
    chunked_attention_backward,
    chunked_forward,
    head_by_head_forward,
)
from mha_lab.measure import (
    fit_exponent,
    interleaved_times,
    torch_peak_memory,
    traced_memory,
)
from mha_lab.plots.style import check, legend_outside, log_ticks, new_figure
from mha_lab.tables import markdown_table

__all__ = [
    "flops_table", "training_flops_table", "memory_table", "heads_table", "kv_cache_table",
    "kv_variants_table", "plot_flops_vs_length", "plot_kv_cache_vs_context",
    "peak_memory_vs_length", "backward_costs", "kernel_backward_costs", "plot_peak_memory", "plot_time_vs_length",
]

_GROUPS = {"projections": ("proj_q", "proj_kv", "proj_o"), "attention core (QK^T, AV)": ("qk", "av"),
           "softmax": ("softmax",)}


def _finish(fig: Figure, ax, legend: str = "right", **labels) -> Figure:
    """Label the axes, add a grid and a legend beside the plot, and check the figure's style."""
    ax.set(**labels)
    for axis in (ax.xaxis, ax.yaxis):
        if axis.get_scale() == "log":
            log_ticks(axis)
    ax.grid(True, which="major", alpha=0.3)
    legend_outside(ax, legend)
    return check(fig)


def flops_table(sizes: Iterable[tuple[int, int, int, int]], softmax_flops: int = 5,
                names: Sequence[str] | None = None) -> str:
    """Forward FLOPs by component for each ``(B, L, d_model, h)``, from ``flops_breakdown``.

    ``names`` (one per size, e.g. the model) become the first column.
    """
    rows = []
    for B, L, d, h in sizes:
        f = flops_breakdown(B, L, d, h, softmax_flops=softmax_flops)
        proj = sum(f[k] for k in _GROUPS["projections"])
        core = f["qk"] + f["av"]
        rows.append((B, L, d, h, *(_gflop(v) for v in (proj, core, f["softmax"], sum(f.values()))),
                     f"{proj / core:.3g}"))
    headers = ["B", "L", "d_model", "h", "projections (GFLOP)", "QK^T + AV (GFLOP)", "softmax (GFLOP)",
               "total (GFLOP)", "projections / core"]
    if names is not None:  # one column per model, so that the table stays narrow
        names = list(names)
        return markdown_table(["one layer", *names], [(name, *col) for name, *col in zip(headers, *rows, strict=True)])
    return markdown_table(headers, rows)


def training_flops_table(batch_size: int, seq_len: int, d_model: int, n_heads: int) -> str:
    """Forward and backward FLOPs by component, full and causal, with each column's total and the step's ratio."""
    args = (batch_size, seq_len, d_model, n_heads)
    cols = [flops_breakdown(*args), backward_flops_breakdown(*args),
            flops_breakdown(*args, causal=True), backward_flops_breakdown(*args, causal=True)]
    rows = [(name, *(f"{c[name]:.3g}" for c in cols)) for name in cols[0]]
    totals = [sum(c.values()) for c in cols]
    rows.append(("**total**", *(f"**{t:.3g}**" for t in totals)))
    rows.append(("forward + backward", f"{totals[0] + totals[1]:.3g}", "", f"{totals[2] + totals[3]:.3g}", ""))
    return markdown_table(["component", "forward", "backward", "forward, causal", "backward, causal"], rows)


def _gflop(flops: float) -> str:
    """FLOPs in GFLOP (1e9) with three significant digits and no exponent: 0.0629, 4.83, 2,470."""
    g = flops / 1e9
    digits = max(0, 2 - int(np.floor(np.log10(g)))) if g > 0 else 0
    return f"{float(f'{g:.3g}'):,.{digits}f}"


def memory_table(sizes: Iterable[tuple[int, int, int, int]], dtype: DType = "float32",
                 names: Sequence[str] | None = None) -> str:
    """Bytes kept for the backward, by tensor (rows), for each ``(B, L, d_model, h)`` (columns), in MiB
    (2**20 bytes), with the total and the share of the attention weights A."""
    sizes = list(sizes)
    names = list(names) if names is not None else [f"B={B}, L={L}, d_model={d}, h={h}" for B, L, d, h in sizes]
    parts = [memory_breakdown(B, L, d, h, dtype=dtype) for B, L, d, h in sizes]
    rows = [(f"{tensor} (MiB)", *(f"{p[tensor] / 2**20:,.1f}" for p in parts)) for tensor in parts[0]]
    rows.append(("total (MiB)", *(f"{sum(p.values()) / 2**20:,.1f}" for p in parts)))
    rows.append(("share of A", *(f"{p['attention_weights'] / sum(p.values()):.0%}" for p in parts)))
    return markdown_table(["kept for the backward", *names], rows)


def heads_table(batch_size: int, seq_len: int, d_model: int, heads: Iterable[int], dtype: DType = "float16") -> str:
    """What changes with the number of heads at fixed d_model: matmul FLOPs (nothing), softmax FLOPs and
    the attention-weight memory (both grow like h)."""
    rows = []
    for h in heads:
        f = flops_breakdown(batch_size, seq_len, d_model, h)
        matmul = sum(v for k, v in f.items() if k != "softmax")
        a = memory_breakdown(batch_size, seq_len, d_model, h, dtype=dtype)["attention_weights"]
        rows.append((h, d_model // h, f"{matmul:.4e}", f"{f['softmax']:.3e}", f"{f['softmax'] / matmul:.2%}",
                     f"{a / 2**20:,.0f}"))
    return markdown_table(["h", "d_k", "matmul FLOPs", "softmax FLOPs", "softmax / matmul",
                           f"attention weights (MiB, {dtype})"], rows)


def kv_cache_table(seq_len: int = 4096, dtype: DType = "float16", configs: Iterable[ModelConfig] | None = None) -> str:
    """Each model's attention shape and KV cache per token and at ``seq_len`` tokens (batch 1), in binary units."""
    rows = []
    for c in configs or MODEL_CONFIGS.values():
        per_token = kv_cache_bytes(c, 1, dtype=dtype)
        full = kv_cache_bytes(c, seq_len, dtype=dtype)
        rows.append((c.name, c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.kind,
                     c.sliding_window or "-", f"{per_token / 2**10:,.0f}", f"{gib(full):.3g}"))
    return markdown_table(["model", "layers", "d_model", "h", "h_kv", "d_k", "kind", "window",
                           "KiB / token", f"GiB at {seq_len}"], rows)


def kv_variants_table(config: ModelConfig, gqa_kv_heads: int = 8, seq_len: int = 4096,
                      dtype: DType = "float16") -> str:
    """One MLA model's cache against MHA, GQA and MQA of the same shape (layers, heads, head size).

    Columns: numbers cached per token and layer (``kv_elements_per_token``), per token over all
    layers, KiB per token, GiB at ``seq_len``, and the factor below MHA.
    """
    if config.kind != "MLA":
        raise ValueError(f"{config.name} has no latent (kind {config.kind}); give an MLA configuration")
    plain = replace(config, kv_latent_dim=None, rope_head_dim=None)
    variants = [("MHA", plain), (f"GQA, {gqa_kv_heads} KV heads", replace(plain, n_kv_heads=gqa_kv_heads)),
                ("MQA", replace(plain, n_kv_heads=1)), ("MLA", config)]
    mha = kv_cache_bytes(plain, 1, dtype=dtype)
    rows = []
    for name, c in variants:
        per_token = kv_cache_bytes(c, 1, dtype=dtype)
        rows.append((name, f"{kv_elements_per_token(c):,}", f"{kv_elements_per_token(c) * c.n_layers:,}",
                     f"{per_token / 2**10:,.1f}", f"{gib(kv_cache_bytes(c, seq_len, dtype=dtype)):.3g}",
                     f"{mha / per_token:.3g}"))
    return markdown_table(["cache", "numbers / token / layer", f"numbers / token ({config.n_layers} layers)",
                           f"KiB / token ({dtype})", f"GiB at {seq_len:,}", "times smaller than MHA"], rows)


def plot_flops_vs_length(d_model: int = 4096, n_heads: int = 32, lengths: Sequence[int] | None = None) -> Figure:
    """Forward FLOPs per sequence (B = 1) of projections, attention core and softmax against L, log-log.

    The core (:math:`4L^2d`) overtakes the projections (:math:`8Ld^2`) at :math:`L = 2d`.
    """
    L = np.asarray(lengths if lengths is not None else np.geomspace(128, 16 * d_model, 40).astype(int))
    fig, ax = new_figure(3.8)
    for label, keys in _GROUPS.items():
        ax.loglog(L, [sum(flops_breakdown(1, int(n), d_model, n_heads)[k] for k in keys) for n in L], label=label)
    ax.axvline(2 * d_model, color="gray", linestyle="--", linewidth=1)
    ax.annotate(f"L = 2·d_model = {2 * d_model}", (2 * d_model, ax.get_ylim()[0]), xytext=(4, 8),
                textcoords="offset points", rotation=90, color="gray")
    return _finish(fig, ax, xlabel="sequence length L (tokens)", ylabel="forward FLOPs per sequence",
                   title=f"One attention layer, d_model = {d_model}, h = {n_heads}")


def plot_kv_cache_vs_context(lengths: Sequence[int] | None = None, dtype: DType = "float16",
                             configs: Iterable[ModelConfig] | None = None) -> Figure:
    """KV cache of one sequence against context length, one line per model, log-log, in GiB.

    A model's line ends, with a dot, at its ``max_context``: longer contexts are hypothetical.
    """
    L = np.asarray(lengths if lengths is not None else np.geomspace(128, 8192, 40).astype(int))
    fig, ax = new_figure(4.6)
    for c in configs or MODEL_CONFIGS.values():
        style = {"MHA": "-", "GQA": "--", "MQA": ":"}[c.kind]
        n = L if c.max_context is None else np.append(L[L < c.max_context], c.max_context)
        y = [gib(kv_cache_bytes(c, int(t), dtype=dtype)) for t in n]
        (line,) = ax.loglog(n, y, style, label=f"{c.name} ({c.kind}, {c.n_kv_heads} KV heads)")
        if c.max_context is not None:
            ax.plot(n[-1], y[-1], "o", color=line.get_color())
    return _finish(fig, ax, legend="below", xlabel="context length (tokens)",
                   ylabel=f"KV cache (GiB, {dtype})", title="KV cache of one sequence against context length")


def peak_memory_vs_length(lengths: Sequence[int] = (128, 256, 512, 1024, 2048), d_model: int = 256,
                          n_heads: int = 8, batch_size: int = 1, block: int = 64, repeat: int = 1
                          ) -> dict[str, list[int]]:
    """Measured peak bytes of one layer's forward (float64) for the fused, head-by-head and chunked methods.

    Uses ``mha_lab.measure.traced_memory`` (tracemalloc; the smallest of ``repeat`` runs) and
    ``chunked_forward``, with small blocks so that the chunked method's linear growth shows at lengths a book
    page can afford.
    """
    layer = MultiHeadAttention(d_model, n_heads, seed=0)
    rng = np.random.default_rng(0)
    methods = {
        "fused (layer.forward)": lambda X: layer.forward(X),
        "head by head": lambda X: head_by_head_forward(X, layer),
        f"chunked (blocks of {block})": lambda X: chunked_forward(X, layer, block_q=block, block_k=block),
    }
    peaks: dict[str, list[int]] = {name: [] for name in methods}
    for L in lengths:
        X = rng.normal(size=(batch_size, L, d_model))
        for name, method in methods.items():
            peaks[name].append(traced_memory(lambda m=method, X=X: m(X), repeat)[1])
            layer.clear_cache()  # drop the fused forward's cache before the next measurement
    return peaks


def _step_costs(layer: MultiHeadAttention, X: np.ndarray, G: np.ndarray, block: int, repeat: int) -> list[dict]:
    steps = {"fused": layer, "checkpointed": Checkpointed(layer),
             "chunked": ChunkedLayer(layer, block_q=block, block_k=block)}
    rows = []
    for name, step in steps.items():
        layer.clear_cache()
        kept = traced_memory(lambda s=step: s.forward(X))[0]
        working = traced_memory(lambda s=step: s.backward(G))[1]
        rows.append({"method": name, "L": X.shape[1], "kept": kept, "peak": kept + working})
    def timed(step: MultiHeadAttention | Checkpointed | ChunkedLayer) -> Callable[[], object]:
        return lambda: (layer.clear_cache(), step.forward(X), step.backward(G))  # each step starts with no cache

    times = interleaved_times({name: timed(step) for name, step in steps.items()}, repeat=repeat, warmup=0,
                              clock=time.process_time)
    layer.clear_cache()
    return [{**row, "seconds": times[row["method"]]} for row in rows]


def backward_costs(lengths: Sequence[int] = (512, 1024, 2048), d_model: int = 256, n_heads: int = 8,
                   batch_size: int = 1, block: int = 128, repeat: int = 2) -> list[dict]:
    """Measured memory and time of one layer's training step (float64) with three ways to feed the backward.

    ``fused``: ``layer.forward`` caches A; ``checkpointed``: keeps X and reruns the forward;
    ``chunked``: ``ChunkedLayer``, which rebuilds A tile by tile (blocks of ``block``). Per method
    and length: ``kept`` bytes between forward and backward, ``peak`` bytes in use during the
    backward (``kept`` plus its working memory, both from tracemalloc) and ``seconds`` of CPU
    time for forward plus backward (median of ``repeat`` interleaved runs; run single-threaded).
    """
    rng = np.random.default_rng(0)
    layer = MultiHeadAttention(d_model, n_heads, seed=0)
    rows = []
    for L in lengths:
        X, G = rng.standard_normal((2, batch_size, L, d_model))  # input and dL/d out, (B, L, d_model) each
        rows += _step_costs(layer, X, G, block, repeat)
    return rows


def _core_backward_costs(Q: np.ndarray, K: np.ndarray, V: np.ndarray, dO: np.ndarray, block: int) -> list[dict]:
    import torch

    from mha_lab.cuda.flash import flash_attention_backward

    O, lse = chunked_attention(Q, K, V, return_lse=True)
    t = [torch.from_numpy(a) for a in (Q, K, V, O, lse, dO)]
    scale = 1.0 / np.sqrt(Q.shape[-1])
    calls = {
        "chunked_attention_backward (NumPy)": (
            lambda: chunked_attention_backward(dO, Q, K, V, O, lse, block_q=block, block_k=block),
            lambda f: traced_memory(f)[1]),
        "flash_attention_backward (PyTorch)": (
            lambda: flash_attention_backward(*t[:5], t[5], False, scale, block_q=block), torch_peak_memory),
    }
    times = interleaved_times({name: fn for name, (fn, _) in calls.items()}, repeat=2, warmup=0,
                              clock=time.process_time)
    return [{"method": name, "L": Q.shape[2], "peak": measure(fn), "seconds": times[name]}
            for name, (fn, measure) in calls.items()]


def kernel_backward_costs(lengths: Sequence[int] = (512, 1024, 2048), n_heads: int = 8, head_dim: int = 32,
                          block: int = 128) -> list[dict]:
    """Peak working memory and time of the attention core's backward alone, float64, on the CPU.

    Compares NumPy's ``chunked_attention_backward`` (tiles of ``block`` x ``block``) with the
    PyTorch backward of the Triton kernel, ``flash_attention_backward``, which rebuilds P one
    block of ``block`` query rows against all L keys. Inputs and saved tensors exist before
    the measurement; only the backward's own allocations count. Times are CPU seconds (run
    single-threaded).
    """
    rng = np.random.default_rng(0)
    rows = []
    for L in lengths:
        Q, K, V, dO = rng.standard_normal((4, 1, n_heads, L, head_dim))  # (B, h, L, d_k) each
        rows += _core_backward_costs(Q, K, V, dO, block)
    return rows


def plot_peak_memory(lengths: Sequence[int], peaks: dict[str, Sequence[int]], fit_from: int = 512) -> Figure:
    """Measured peak memory against L, log-log, with the exponent k of a fit :math:`c L^k` per method."""
    fig, ax = new_figure(3.8)
    L = np.asarray(lengths)
    for name, ys in peaks.items():
        ys = np.asarray(ys) / 2**20
        sel = L >= fit_from
        k = fit_exponent(L[sel], ys[sel])
        ax.loglog(L, ys, "o-", label=f"{name}: ~L^{k:.2f}")
    return _finish(fig, ax, legend="below", xlabel="sequence length L (tokens)",
                   ylabel="peak memory of the forward (MiB)",
                   title=f"Measured with tracemalloc (fit over L ≥ {fit_from})")


def plot_time_vs_length(lengths: Sequence[int], seconds: Sequence[float], d_model: int, n_heads: int,
                        batch_size: int = 1) -> Figure:
    """Measured forward time against L next to the FLOP formula scaled to the largest measurement, log-log."""
    L = np.asarray(lengths)
    t = np.asarray(seconds)
    flops = np.array([sum(flops_breakdown(batch_size, int(n), d_model, n_heads).values()) for n in L])
    core = np.array([(lambda f: f["qk"] + f["av"] + f["softmax"])(flops_breakdown(batch_size, int(n), d_model,
                                                                                   n_heads)) for n in L])
    k = fit_exponent(L, t)
    fig, ax = new_figure(3.8)
    ax.loglog(L, t * 1e3, "o-", label=f"measured (log-log fit: L^{k:.2f})")
    ax.loglog(L, flops * t[-1] / flops[-1] * 1e3, "--", label="count_flops, scaled to the last point")
    ax.loglog(L, core * t[-1] / flops[-1] * 1e3, ":", label="its L² part (core + softmax)")
    return _finish(fig, ax, legend="below", xlabel="sequence length L (tokens)", ylabel="forward time (ms)",
                   title=f"B = {batch_size}, d_model = {d_model}, h = {n_heads}")

"""Decoding with a KV cache, measured here: time per token against context length, and what a
decoding step computes per byte it reads (its arithmetic intensity).

Tables come back as Markdown strings, figures as checked matplotlib figures.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace
from functools import partial

import numpy as np
from matplotlib.figure import Figure

from mha_lab.analysis import (
    DECODE_VARIANTS,
    DEEPSEEK_V2,
    GPU_PEAKS,
    MODEL_CONFIGS,
    DType,
    ModelConfig,
    decode_attention_intensity,
    decode_step_cost,
)
from mha_lab.cpu import GroupedQueryAttention, KVCache, decode_step
from mha_lab.measure import blas_threads, gemm_flops_per_second, interleaved_times, read_bytes_per_second
from mha_lab.plots.style import check, legend_outside, log_ticks, new_figure
from mha_lab.tables import markdown_table
from mha_lab.verdict import roofline

__all__ = ["decode_times", "plot_decode_times", "decode_times_table", "intensity_table", "main"]


def decode_times(context_lengths: Sequence[int], d_model: int = 1024, n_heads: int = 8,
                 kv_heads: dict[str, int] | None = None, batch_size: int = 1, dtype: DType = "float32",
                 repeat: int = 9) -> dict[str, list[float]]:
    """Seconds of one ``decode_step`` at each context length, per head layout, timed side by side.

    ``kv_heads`` maps a label to h_kv (default MHA, GQA with h/4, MQA). The cache is filled
    with random keys and values first: a step's time does not depend on their values, so no
    prefill is timed. The warm-up and ``repeat`` steps add a few positions to each context.
    Each time is the fastest of ``repeat`` steps: on a shared machine other work only adds time.
    """
    kv_heads = kv_heads or {"MHA": n_heads, "GQA": max(1, n_heads // 4), "MQA": 1}
    rng = np.random.default_rng(0)
    layers = {name: GroupedQueryAttention(d_model, n_heads, g, seed=0, dtype=dtype) for name, g in kv_heads.items()}
    x = rng.standard_normal((batch_size, 1, d_model)).astype(dtype)  # (B, 1, d_model): one new token
    times: dict[str, list[float]] = {name: [] for name in layers}
    for t in context_lengths:
        steps = {}
        for name, layer in layers.items():
            cache = KVCache.for_layer(layer, batch_size, max_len=t + repeat + 1)
            shape = (batch_size, layer.num_kv_heads, t, layer.d_k)
            k = rng.standard_normal(shape, dtype=np.float32).astype(dtype, copy=False)  # no copy for float32
            cache.append(k, k)  # (B, h_kv, t, d_k): t positions already decoded
            steps[name] = partial(decode_step, layer, x, cache)
        for name, seconds in interleaved_times(steps, repeat, warmup=1, statistic="min").items():
            times[name].append(seconds)
    return times


def plot_decode_times(context_lengths: Sequence[int], times: dict[str, Sequence[float]],
                      d_model: int, n_heads: int) -> Figure:
    """Measured time per decoded token (ms) against context length, one line per layout, log-log."""
    fig, ax = new_figure(3.6)
    for name, seconds in times.items():
        ax.loglog(context_lengths, np.asarray(seconds) * 1e3, "o-", label=name)
    ax.set_xticks(context_lengths, [f"{t:,}" for t in context_lengths], minor=False)
    ax.minorticks_off()
    log_ticks(ax.yaxis)
    ax.set(xlabel="context length (tokens)", ylabel="time per token (ms)",
           title=f"One layer decoding, d_model = {d_model}, h = {n_heads}")
    ax.grid(True, which="major", alpha=0.3)
    legend_outside(ax)
    return check(fig)


def decode_times_table(context_lengths: Sequence[int], times: dict[str, Sequence[float]], d_model: int,
                       n_heads: int, kv_heads: dict[str, int], dtype: DType = "float32") -> str:
    """Time per token in ms, with the bytes the step reads per second in GB/s in brackets, per
    layout and context length, and the ratio of the first two layouts' times."""
    names = list(times)
    rows = []
    for i, t in enumerate(context_lengths):
        row = [f"{t:,}"]
        for name in names:
            cost = decode_step_cost(d_model, n_heads, kv_heads[name], t, dtype=dtype)
            seconds = times[name][i]
            row.append(f"{seconds * 1e3:.2g} ({(cost['weight_bytes'] + cost['cache_bytes']) / seconds / 1e9:.2g})")
        row.append(f"{times[names[0]][i] / times[names[1]][i]:.1f}")
        rows.append(row)
    return markdown_table(["context"] + [f"{n}: ms (GB/s)" for n in names] + [f"{names[0]} / {names[1]}"], rows)


def intensity_table(configs: Sequence[ModelConfig], context_len: int, batch_sizes: Sequence[int],
                    dtype: DType = "float16") -> str:
    """FLOPs per byte read of one decoding step of one layer, whole step and attention alone."""
    rows = []
    for c in configs:
        for B in batch_sizes:
            cost = decode_step_cost(c.d_model, c.n_heads, c.n_kv_heads, context_len, B, dtype)
            flops, read = cost["proj_flops"] + cost["attn_flops"], cost["weight_bytes"] + cost["cache_bytes"]
            rows.append((f"{c.name} ({c.kind})", B, f"{flops / 1e6:,.0f}", f"{read / 2**20:,.0f}",
                         f"{flops / read:.2g}", f"{cost['attn_flops'] / cost['cache_bytes']:.2g}"))
    return markdown_table(["model", "batch", "MFLOP", "MiB read", "FLOPs / byte", "attention alone"], rows)


def main(argv: list[str] | None = None) -> int:
    """``python -m mha_lab decode``: time a decoding step here and print decode's FLOPs per byte."""
    parser = argparse.ArgumentParser(prog="python -m mha_lab decode", description=main.__doc__)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args(argv)
    blas_threads(1)
    kv_heads = {"MHA": args.heads, "GQA": max(1, args.heads // 4), "MQA": 1}
    times = decode_times(args.contexts, args.d_model, args.heads, kv_heads, repeat=args.repeat)
    print(f"One layer, d_model = {args.d_model}, h = {args.heads}, float32, batch 1, one BLAS thread\n")
    print(decode_times_table(args.contexts, times, args.d_model, args.heads, kv_heads))
    print("\nOne decoding step of one layer at 4096 cached tokens, float16\n")
    print(intensity_table([MODEL_CONFIGS["Llama-2-7B"], MODEL_CONFIGS["Llama-3-8B"]], 4096, (1, 64)))
    flops, bandwidth = GPU_PEAKS["H100 SXM"]
    ridge_here = gemm_flops_per_second() / read_bytes_per_second()
    print(f"\nRidge point (FLOPs per byte): this machine {ridge_here:.2g}, H100 SXM {flops / bandwidth:.0f}")
    ds = DEEPSEEK_V2
    per_variant = {f"GQA with {g} K/V heads" if kind == "GQA" else kind: decode_attention_intensity(
        replace(ds, n_kv_heads=g, kv_latent_dim=None, rope_head_dim=None), "bfloat16")
        for kind, g in (("MHA", ds.n_heads), ("GQA", 8), ("MQA", 1))}
    per_variant.update({v: decode_attention_intensity(ds, "bfloat16", v) for v in DECODE_VARIANTS[1:]})
    print(f"\nAttention's FLOPs per byte of cache, {ds.name}'s heads in bfloat16, against the H100's ridge: "
          f"{roofline(per_variant, flops / bandwidth)}")
    return 0

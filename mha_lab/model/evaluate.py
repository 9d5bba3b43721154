"""What the course's model does under a server's cache: sinks, windows, quantised caches, long contexts, GQA.

``python -m mha_lab lm-eval`` measures everything on the stored weights and writes
``mha_lab/model/measurements.json``, which the decoding and GQA chapters render; each
measurement is a function here, and ``tests/test_model.py`` recomputes a part of the file.
Perplexity is per byte, :math:`\\exp` of the mean cross-entropy in nats, over every predicted
byte of held-out files (``corpus.long_documents``: each row one unbroken file after ``BOS``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from mha_lab.model import MEASUREMENTS, WEIGHTS, corpus
from mha_lab.model.caches import (
    fake_quant_core,
    kivi_bytes_per_token,
    kivi_core,
    streaming_core,
    uniform_bytes_per_token,
)
from mha_lab.model.train import GQA, LONG, load
from mha_lab.model.transformer import BOS, SCALINGS, VOCAB, ByteLM, Core, Rope, causal_core, eager_core, pool_kv_heads

__all__ = ["MEASUREMENTS", "EVAL", "token_nll", "perplexity", "attention_to_first", "recompute_nll",
           "streaming_table", "quantized_table", "long_context_table", "gqa_table", "measure", "main"]

EVAL = {"docs": 8, "stream": 4, "window": 64, "sinks": 4, "group": 32, "residuals": (128, 32), "lengths": (1, 2, 4, 8)}
"""``docs`` held-out files; streams of ``stream`` x the training length; StreamingLLM's window and sinks;
KIVI's group and residuals (the paper's 128, and one group); the context lengths, in training lengths,
of the long-context table."""


@torch.no_grad()
def token_nll(model: ByteLM, tokens: np.ndarray, **kwargs: object) -> np.ndarray:
    """Cross-entropy (nats) of each predicted token: (B, L) tokens -> (B, L - 1); ``kwargs`` go to the model."""
    x = torch.from_numpy(tokens)
    logits = model(x[:, :-1], **kwargs)  # (B, L - 1, VOCAB)
    return F.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1), reduction="none").view(
        x.shape[0], -1).numpy()


def perplexity(nll: np.ndarray) -> float:
    """exp of the mean cross-entropy."""
    return float(np.exp(np.mean(nll)))


@torch.no_grad()
def attention_to_first(model: ByteLM, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The weight every head gives position 0, and (sink-logit models) the weight its sink logit takes.

    Returns two (layers, heads, L) arrays averaged over the batch: A[:, :, t, 0] and 1 - sum_j A[:, :, t, j].
    """
    weights: list[torch.Tensor] = []
    model(torch.from_numpy(tokens), core=partial(eager_core, weights_out=weights))
    first = np.stack([w[..., 0].mean(0).numpy() for w in weights])  # (layers, h, L)
    to_sink = np.stack([(1 - w.sum(-1)).mean(0).numpy() for w in weights])
    return first, to_sink


@torch.no_grad()
def recompute_nll(model: ByteLM, tokens: np.ndarray, window: int, start_token: bool = False,
                  chunk: int = 512) -> np.ndarray:
    """Sliding window with re-computation: each token predicted from the last ``window`` tokens alone, run
    afresh at positions 0..window-1 (StreamingLLM's accurate, slow baseline); with ``start_token``, the
    window's first token is replaced by ``BOS``, as every training window began. (B, L) -> (B, L - 1)."""
    B, L = tokens.shape
    if window >= L:  # every prediction sees its whole prefix
        return token_nll(model, tokens)
    head = token_nll(model, tokens[:, :window])  # the first window - 1 predictions see their whole prefix
    # (B, L) -> (B, L - window, window + 1): each row a window and the token after it (tokens window..L-1)
    rows = np.lib.stride_tricks.sliding_window_view(tokens, window + 1, axis=1)
    flat = np.array(rows.reshape(-1, window + 1))
    if start_token:
        flat[:, 0] = BOS
    x = torch.from_numpy(flat)
    nll = np.concatenate([
        F.cross_entropy(model(x[i:i + chunk, :-1])[:, -1], x[i:i + chunk, -1], reduction="none").numpy()
        for i in range(0, len(x), chunk)])
    return np.concatenate([head, nll.reshape(B, -1)], axis=1)


def streaming_table(model: ByteLM, tokens: np.ndarray, window: int, sinks: int) -> dict[str, float]:
    """Perplexity over a stream (B, L) with the full cache, a window, a window plus sinks, and re-computation
    (plain, and with the start token first)."""
    return {"full cache": perplexity(token_nll(model, tokens)),
            "window": perplexity(token_nll(model, tokens, core=streaming_core(window, 0))),
            "window + sinks": perplexity(token_nll(model, tokens, core=streaming_core(window, sinks))),
            "re-computation": perplexity(recompute_nll(model, tokens, window)),
            "re-computation, start token first": perplexity(recompute_nll(model, tokens, window, start_token=True))}


def quantized_table(model: ByteLM, tokens: np.ndarray, group: int,
                    residuals: tuple[int, ...]) -> dict[str, dict[str, float]]:
    """Perplexity and cache bytes per token and layer (KIVI's float16 residual not counted) for a float16
    cache and each quantised one."""
    cfg = model.cfg
    h_kv, d = cfg.num_kv_heads, cfg.head_dim
    schemes: dict[str, tuple[Core, float]] = {
        "float16": (causal_core, 2 * 2 * h_kv * d),
        "int8, a scale per token": (fake_quant_core("int8", "token"), uniform_bytes_per_token(h_kv, d, True)),
        "fp8 e4m3, one scale per layer": (fake_quant_core("fp8", "layer"),
                                          uniform_bytes_per_token(h_kv, d, False)),
    }
    for bits in (4, 2):
        for r in residuals:
            schemes[f"KIVI {bits}-bit, R = {r}"] = (kivi_core(bits, group, r),
                                                    kivi_bytes_per_token(bits, group, h_kv, d))
    return {name: {"perplexity": perplexity(token_nll(model, tokens, core=core)), "bytes": float(nbytes)}
            for name, (core, nbytes) in schemes.items()}


def long_context_table(models: dict[str, ByteLM], tokens: np.ndarray, lengths: tuple[int, ...],
                       factor: float) -> dict[str, dict[str, float]]:
    """Perplexity of the first n tokens of each row, n = each of ``lengths``, for each model keyed by its
    RoPE scaling (stretched by ``factor``)."""
    out = {}
    for method, model in models.items():
        cfg = model.cfg
        rope = Rope.scaled(method, cfg.head_dim, factor, cfg.train_len, cfg.rope_base)
        out[method] = {str(n): perplexity(token_nll(model, tokens[:, :n], rope=rope)) for n in lengths}
    return out


def gqa_table(models: dict[str, ByteLM], tokens: np.ndarray) -> dict[str, dict[str, float]]:
    """Perplexity and float16 cache bytes per token and layer of each model."""
    return {name: {"perplexity": perplexity(token_nll(m, tokens)), "kv_heads": m.cfg.num_kv_heads,
                   "bytes": 2 * 2 * m.cfg.num_kv_heads * m.cfg.head_dim} for name, m in models.items()}


def measure(folder: Path = WEIGHTS) -> dict:
    """Every measurement the chapters show, on the weights in ``folder``."""
    torch.set_num_threads(1)
    base, sink = load("base", folder), load("sink-logit", folder)
    L = base.cfg.train_len
    docs, stream_len = EVAL["docs"], EVAL["stream"] * L
    at_train = corpus.long_documents(docs, L)
    stream = corpus.long_documents(docs, stream_len)
    longest = corpus.long_documents(docs, max(EVAL["lengths"]) * L)
    out: dict = {"eval": {**EVAL, "train_len": L}}
    started = time.perf_counter()
    for name, model in (("base", base), ("sink-logit", sink)):
        first, to_sink = attention_to_first(model, at_train)
        out[name] = {"attention_to_first": first.round(4).tolist(),
                     "attention_to_sink_logit": to_sink.round(4).tolist(),
                     "streaming": streaming_table(model, stream, EVAL["window"], EVAL["sinks"]),
                     "quantized": quantized_table(model, at_train, EVAL["group"], EVAL["residuals"])}
    lengths = tuple(n * L for n in EVAL["lengths"])
    out["long"] = {"before": long_context_table({m: base for m in SCALINGS}, longest, lengths, LONG["factor"]),
                   "after": long_context_table({m: load(f"long-{m}", folder) for m in SCALINGS}, longest, lengths,
                                               LONG["factor"])}
    pooled_name = f"gqa-{GQA['num_kv_heads']}"
    out["gqa"] = gqa_table({"trained": base, "mean-pooled": pool_kv_heads(base, GQA["num_kv_heads"]),
                            "mean-pooled, uptrained": load(pooled_name, folder)}, at_train)
    out["seconds"] = round(time.perf_counter() - started, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mha_lab lm-eval",
        description="Measure the course's trained model (sinks, sliding windows, quantised caches, RoPE past "
                    "the training length, GQA conversion) and write the JSON the chapters render "
                    "(a few minutes on one thread; the file records how long it took).")
    parser.add_argument("--out", type=Path, default=MEASUREMENTS, help=f"where to write (default {MEASUREMENTS})")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    result = measure()
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} in {result['seconds']} s")
    return 0

r"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023), in NumPy, over paged caches.

A cheap **draft** model proposes k tokens one by one, :math:`x_i \sim q_i`; the **target**
scores all of them in one pass, which gives its distributions :math:`p_1 \dots p_{k+1}`. Token
:math:`x_i` is accepted with probability :math:`\min(1, p_i(x_i)/q_i(x_i))`; at the first
rejection a replacement is drawn from the **residual**

.. math:: r_i(x) = \frac{\max(0,\, p_i(x) - q_i(x))}{\sum_y \max(0,\, p_i(y) - q_i(y))},

and the step ends; if all k are accepted, a bonus token is drawn from :math:`p_{k+1}`. Every
token out is then distributed exactly as the target alone would sample it. The caches hold the
keys and values of all k drafts; those of the rejected ones are rolled back.

Randomness goes through a ``Draw`` (``accept``, ``sample``), so that ``enumerate_outcomes`` can
follow every branch of a run with its exact probability.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from mha_lab.cpu.functional import softmax
from mha_lab.cpu.paged import PagedKVCache
from mha_lab.cpu.tiny_lm import TinyLM

__all__ = ["Draw", "RandomDraw", "UniformDraw", "acceptance_probability", "residual", "verify", "SpecStats",
           "speculative_generate", "plain_generate", "enumerate_outcomes", "expected_tokens",
           "expected_speedup"]


class Draw(Protocol):
    """A source of randomness: a coin and a categorical draw."""

    def accept(self, prob: float) -> bool: ...

    def sample(self, probs: np.ndarray) -> int: ...


class RandomDraw:
    """Draws from a NumPy generator."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)

    def accept(self, prob: float) -> bool:
        return bool(self.rng.random() < prob)

    def sample(self, probs: np.ndarray) -> int:
        return int(self.rng.choice(len(probs), p=probs))


class UniformDraw:
    """Draws read from given uniform numbers: the i-th coin is ``u[i] < prob``; a token is drawn from ``probs`` by
    its inverse CDF at ``r``, the first token whose cumulative probability exceeds r. Deterministic, so that two
    implementations of the rule can be compared on the same randomness."""

    def __init__(self, u: np.ndarray, r: float) -> None:
        self.u, self.r, self.coins = np.asarray(u, dtype=float), float(r), 0

    def accept(self, prob: float) -> bool:
        self.coins += 1
        return bool(self.u[self.coins - 1] < prob)

    def sample(self, probs: np.ndarray) -> int:
        return int(min(np.searchsorted(np.cumsum(probs), self.r, side="right"), len(probs) - 1))


def acceptance_probability(p: np.ndarray, q: np.ndarray, token: int) -> float:
    r"""The chance of keeping a drafted ``token``: :math:`\min(1, p(x)/q(x))`; p, q (V,) distributions."""
    return float(min(1.0, p[token] / q[token]))


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    r"""Where the target has more mass than the draft, normalised: :math:`\max(0, p - q) / \sum \max(0, p - q)`.

    When q = p no token is ever rejected and the residual is never drawn from; p is returned.
    """
    r = np.maximum(p - q, 0.0)
    return r / r.sum() if r.sum() > 0 else p


def verify(p: np.ndarray, q: np.ndarray, drafted: list[int], draw: Draw) -> list[int]:
    """The modified rejection rule: accepted drafts, then a residual or bonus token.

    Shapes: p (k+1, V) the target's distributions after each draft prefix; q (k, V)
    the draft's; ``drafted`` the k tokens. Returns between 1 and k+1 tokens.
    """
    k = len(drafted)
    if p.shape[0] != k + 1 or q.shape[0] != k:
        raise ValueError(f"{k} drafted tokens need p of k+1 = {k + 1} rows and q "
                         f"of k rows; got {p.shape[0]} and {q.shape[0]}")
    out = []
    for i, x in enumerate(drafted):
        if not draw.accept(acceptance_probability(p[i], q[i], x)):
            return out + [draw.sample(residual(p[i], q[i]))]
        out.append(x)
    return out + [draw.sample(p[k])]


@dataclass
class SpecStats:
    """Counts of one generation: target passes, acceptance tests, drafts accepted, tokens out."""

    rounds: int = 0
    tested: int = 0
    accepted: int = 0
    tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts per acceptance test."""
        return self.accepted / self.tested


def speculative_generate(target: TinyLM, draft: TinyLM, prompt: list[int], n: int, k: int, draw: Draw,
                         block_size: int = 4, num_blocks: int = 256) -> tuple[list[int], SpecStats]:
    """``n`` new tokens sampled from ``target`` with ``k`` drafts per round; returns them and the counts.

    Each model keeps a paged cache of every token but the last one emitted; a round feeds each
    model the tokens it has not seen, the draft samples k tokens, the target scores them in one
    step, and both caches are truncated back to the tokens kept.
    """
    if k < 1 or n < 1:
        raise ValueError(f"k and n must be at least 1, got k={k}, n={n}")
    tokens, stats = list(prompt), SpecStats()
    models = {"target": target, "draft": draft}
    caches = {role: PagedKVCache.for_layer(m.layer, num_blocks, block_size) for role, m in models.items()}
    seq = {role: caches[role].add_sequence() for role in models}

    def run(role: str, new: list[int]) -> np.ndarray:
        """Feed ``role`` the tokens its cache lacks, then ``new``: logits (n, V) of all of them."""
        unseen = tokens[caches[role].lengths[seq[role]]:]
        return models[role].step(caches[role], {seq[role]: unseen + new})[seq[role]]

    while len(tokens) < len(prompt) + n:
        drafted, q = [], []
        logits = run("draft", [])[-1]
        for i in range(k):
            q.append(softmax(logits))
            drafted.append(draw.sample(q[-1]))
            if i < k - 1:
                logits = run("draft", drafted[-1:])[-1]
        scored = run("target", drafted)  # the target scores every draft in one step
        out = verify(softmax(scored[-(k + 1):]), np.array(q), drafted, draw)
        tokens += out
        for role in models:  # roll back: keep the keys of every token but the last one out
            caches[role].truncate(seq[role], min(caches[role].lengths[seq[role]], len(tokens) - 1))
        stats.rounds += 1
        stats.accepted += len(out) - 1
        stats.tested += min(len(out), k)
        stats.tokens += len(out)
    return tokens[len(prompt):len(prompt) + n], stats


def plain_generate(model: TinyLM, prompt: list[int], n: int, draw: Draw) -> list[int]:
    """``n`` tokens sampled one at a time from whole-sequence forwards: the counterpart without any cache."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(draw.sample(softmax(model.forward(np.array([tokens]))[0, -1])))
    return tokens[len(prompt):]


class _Replay:
    """A ``Draw`` that follows a given path of choices, then the first possible one, recording the options."""

    def __init__(self, path: list[int]) -> None:
        self.path, self.choices, self.options, self.prob = path, [], [], 1.0

    def _choose(self, weights: np.ndarray) -> int:
        depth = len(self.choices)
        possible = [int(i) for i in np.flatnonzero(weights > 0)]
        choice = self.path[depth] if depth < len(self.path) else possible[0]
        self.choices.append(choice)
        self.options.append(possible)
        self.prob *= float(weights[choice])
        return choice

    def accept(self, prob: float) -> bool:
        return self._choose(np.array([prob, 1.0 - prob])) == 0

    def sample(self, probs: np.ndarray) -> int:
        return self._choose(np.asarray(probs))


def enumerate_outcomes(run: Callable[[Draw], Hashable], max_paths: int = 100_000) -> dict[Hashable, float]:
    """Every outcome of the randomised ``run(draw)`` with its exact probability, one replay per branch."""
    dist: dict[Hashable, float] = defaultdict(float)
    stack: list[list[int]] = [[]]
    paths = 0
    while stack:
        paths += 1
        if paths > max_paths:
            raise ValueError(f"more than {max_paths} random paths: enumerate a smaller case")
        path = stack.pop()
        replay = _Replay(path)
        dist[run(replay)] += replay.prob
        for depth in range(len(path), len(replay.choices)):
            stack += [replay.choices[:depth] + [alt] for alt in replay.options[depth] if alt != replay.choices[depth]]
    return dict(dist)


def expected_tokens(rate: float, k: int) -> float:
    r"""Tokens per target pass when each draft is accepted with probability ρ: :math:`(1 - ρ^{k+1}) / (1 - ρ)`."""
    return float(k + 1) if rate == 1 else (1 - rate ** (k + 1)) / (1 - rate)


def expected_speedup(rate: float, k: int, cost_ratio: float) -> float:
    r"""Speed-up over plain decoding when a draft step costs :math:`c_\text{draft}` target steps.

    .. math:: \frac{1 - ρ^{k+1}}{(1 - ρ)(k c_\text{draft} + 1)}
    """
    return expected_tokens(rate, k) / (k * cost_ratio + 1)

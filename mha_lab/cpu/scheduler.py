"""Continuous batching with chunked prefill over a paged block pool (vLLM's scheduler, simplified), in NumPy.

Every engine step gets a **token budget**. Requests already running come first, in the order
they were admitted: a decoding request takes one token, a request still reading its prompt
takes the next **chunk** of it, as much as the budget leaves. Waiting requests are admitted
first come, first served, while the budget, the limit on running requests and the free blocks
allow, so one step mixes prefill chunks with decodes. When a running request needs a block and
none is free, the request admitted last is **preempted**: its blocks are freed and it goes back to
the head of the queue, to recompute its prompt and the tokens it had generated. The step's
work runs through ``TinyLM.step`` and greedy decoding picks each next token.

Time is whatever the caller says a step costs: ``run`` takes a function of the step's chunks,
each ``Chunk(new, context)``, so that the same trace can be priced on any machine.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from mha_lab.cpu.paged import PagedKVCache
from mha_lab.cpu.tiny_lm import TinyLM

__all__ = ["Request", "Chunk", "Served", "ContinuousBatcher", "static_batching", "latency_summary"]


@dataclass(frozen=True)
class Request:
    """A prompt, how many tokens to generate, and when it arrives (seconds)."""

    prompt: tuple[int, ...]
    max_new: int
    arrival: float = 0.0


class Chunk(NamedTuple):
    """One sequence's share of a step: ``new`` tokens computed, ending at position ``context``."""

    new: int
    context: int


@dataclass(eq=False)
class Served:
    """What became of one request: its tokens, when its first and each later token came out."""

    request: Request
    output: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    preemptions: int = 0

    @property
    def ttft(self) -> float:
        """Time to first token: from arrival to the end of the step that produced it."""
        return self.token_times[0] - self.request.arrival

    @property
    def tpot(self) -> float:
        """Time per output token after the first (0 for a single token)."""
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else 0.0


@dataclass(eq=False)
class _Running:
    served: Served
    seq: int
    computed: int = 0  # positions whose keys and values are in the cache

    @property
    def tokens(self) -> list[int]:
        return list(self.served.request.prompt) + self.served.output


class ContinuousBatcher:
    """Serve requests with ``model`` over a pool of ``num_blocks`` blocks of ``block_size`` positions."""

    def __init__(self, model: TinyLM, num_blocks: int, block_size: int = 16, token_budget: int = 256,
                 max_running: int = 8) -> None:
        if token_budget < 1 or max_running < 1:
            raise ValueError(f"token_budget and max_running must be at least 1, got {token_budget}, {max_running}")
        self.model, self.token_budget, self.max_running = model, token_budget, max_running
        self.cache = PagedKVCache.for_layer(model.layer, num_blocks, block_size)
        self.steps: list[list[Chunk]] = []

    def _blocks_needed(self, r: _Running, n: int) -> int:
        """New blocks request r needs to hold n more positions."""
        bs = self.cache.allocator.block_size
        return -(-(r.computed + n) // bs) - len(self.cache.tables[r.seq])

    def _preempt(self, running: list[_Running], waiting: deque[Served]) -> int:
        """Free the request admitted last, which waits first to recompute; returns its blocks."""
        victim = running.pop()
        freed = len(self.cache.tables[victim.seq])
        self.cache.free_sequence(victim.seq)
        victim.served.preemptions += 1
        waiting.appendleft(victim.served)
        return freed

    def _schedule(self, running: list[_Running], waiting: deque[Served],
                  now: float) -> list[tuple[_Running, int]]:
        """This step's (request, tokens) pairs; preempts and admits as it goes."""
        budget, free = self.token_budget, len(self.cache.allocator.free)
        plan, preempted = [], False
        for r in list(running):
            if budget == 0 or r not in running:  # out of tokens, or preempted
                continue
            n = min(len(r.tokens) - r.computed, budget)  # 1 to decode, or a chunk
            while r in running and self._blocks_needed(r, n) > free:
                free += self._preempt(running, waiting)
                preempted = True
            if r in running:
                free -= self._blocks_needed(r, n)
                plan.append((r, n))
                budget -= n
        while (waiting and not preempted and budget
               and len(running) < self.max_running
               and waiting[0].request.arrival <= now):
            r = _Running(waiting[0], self.cache.add_sequence())
            n = min(len(r.tokens), budget)  # a prompt's first chunk
            if self._blocks_needed(r, n) > free:
                self.cache.free_sequence(r.seq)
                break
            waiting.popleft()
            running.append(r)
            free -= self._blocks_needed(r, n)
            plan.append((r, n))
            budget -= n
        return plan

    def run(self, requests: Sequence[Request], step_seconds: Callable[[list[Chunk]], float]) -> list[Served]:
        """Serve every request; ``step_seconds(chunks)`` prices each step. Returns one ``Served`` per request."""
        bs, pool = self.cache.allocator.block_size, self.cache.allocator.num_blocks
        for q in requests:
            if -(-(len(q.prompt) + q.max_new) // bs) > pool or not q.prompt or q.max_new < 1:
                raise ValueError(f"a request of {len(q.prompt)} prompt and {q.max_new} new tokens cannot be "
                                 f"served from {pool} blocks of {bs}")
        served = [Served(q) for q in requests]
        waiting = deque(sorted(served, key=lambda s: s.request.arrival))
        running: list[_Running] = []
        now = 0.0
        while waiting or running:
            plan = self._schedule(running, waiting, now)
            if not plan:
                if not running:  # idle until the next request arrives
                    now = max(now, waiting[0].request.arrival)
                continue
            logits = self.model.step(self.cache, {r.seq: r.tokens[r.computed:r.computed + n] for r, n in plan})
            self.steps.append([Chunk(n, r.computed + n) for r, n in plan])
            now += step_seconds(self.steps[-1])
            for r, n in plan:
                r.computed += n
                if r.computed < len(r.tokens):
                    continue  # a prefill chunk short of the prompt's end produces no token
                r.served.output.append(int(np.argmax(logits[r.seq][-1])))
                r.served.token_times.append(now)
                if len(r.served.output) == r.served.request.max_new:
                    running.remove(r)
                    self.cache.free_sequence(r.seq)
        return served


def static_batching(requests: Sequence[Request], batch_size: int,
                    step_seconds: Callable[[list[Chunk]], float]) -> list[Served]:
    """Times of the same requests served in static batches: up to ``batch_size`` waiting requests at a time.

    A batch pads every prompt to its longest, runs it in one step, then decodes until its longest
    answer is done; the next batch starts after. Only times are computed (no tokens).
    """
    queue = sorted(requests, key=lambda q: q.arrival)
    served: list[Served] = []
    now, i = 0.0, 0
    while i < len(queue):
        now = max(now, queue[i].arrival)
        batch = [q for q in queue[i:i + batch_size] if q.arrival <= now]
        i += len(batch)
        width, longest = max(len(q.prompt) for q in batch), max(q.max_new for q in batch)
        records = [Served(q) for q in batch]
        for j in range(longest):  # step 0 is the padded prefill, the others one token each
            now += step_seconds([Chunk(width if j == 0 else 1, width + j)] * len(batch))
            for s in records:
                if j < s.request.max_new:
                    s.token_times.append(now)
        served += records
    return served


def latency_summary(served: Sequence[Served]) -> dict[str, float]:
    """Mean TTFT and TPOT (seconds), and output tokens per second from the first arrival to the last token."""
    start = min(s.request.arrival for s in served)
    end = max(s.token_times[-1] for s in served)
    return {"ttft": float(np.mean([s.ttft for s in served])), "tpot": float(np.mean([s.tpot for s in served])),
            "throughput": sum(len(s.token_times) for s in served) / (end - start)}

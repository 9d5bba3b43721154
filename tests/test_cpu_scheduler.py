"""Continuous batching with chunked prefill: every request's tokens equal running it alone (greedy, the plain
forward), under chunking, mixed steps and preemption; the token budget and the pool hold; TTFT, TPOT and
throughput on traces small enough to count by hand; static batching's padded steps."""

import numpy as np
import pytest

from mha_lab.cpu.paged import PagedKVCache
from mha_lab.cpu.scheduler import Chunk, ContinuousBatcher, Request, latency_summary, static_batching
from mha_lab.cpu.tiny_lm import TinyLM
from mha_lab.testing import assert_close

MODEL = TinyLM(vocab=32, d_model=16, num_heads=4, num_kv_heads=2, max_len=128, seed=11)


def greedy_alone(request):
    tokens = list(request.prompt)
    for _ in range(request.max_new):
        tokens.append(int(np.argmax(MODEL.forward(np.array([tokens]))[0, -1])))
    return tokens[len(request.prompt):]


def trace(n=7, seed=0):
    rng = np.random.default_rng(seed)
    return [Request(tuple(rng.integers(0, 32, rng.integers(1, 41)).tolist()), int(rng.integers(1, 9)),
                    float(0.5 * i)) for i in range(n)]


def test_a_step_over_mixed_chunks_equals_the_plain_forward():
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 32, (2, 13))
    cache = PagedKVCache.for_layer(MODEL.layer, num_blocks=16, block_size=4)
    s, t = cache.add_sequence(), cache.add_sequence()
    MODEL.step(cache, {s: a[:6].tolist(), t: b[:1].tolist()})
    out = MODEL.step(cache, {s: a[6:7].tolist(), t: b[1:13].tolist()})  # a decode beside a prefill chunk
    full = MODEL.forward(np.stack([a, b]))
    assert_close(out[s], full[0, 6:7])
    assert_close(out[t], full[1, 1:13])
    with pytest.raises(ValueError, match="token ids"):
        MODEL.step(cache, {s: [32]})


def test_every_request_gets_the_tokens_it_gets_alone():
    requests = trace()
    batcher = ContinuousBatcher(MODEL, num_blocks=12, block_size=4, token_budget=16, max_running=4)
    served = batcher.run(requests, lambda chunks: 1.0)
    for s in served:
        assert s.output == greedy_alone(s.request) and len(s.token_times) == s.request.max_new
    # the trace exercised what it is meant to: chunks, steps mixing them with decodes, preemption
    assert sum(s.preemptions for s in served) > 0
    assert any(max(c.new for c in step) > 1 and min(c.new for c in step) == 1 for step in batcher.steps)
    assert all(sum(c.new for c in step) <= 16 for step in batcher.steps)


def test_admitting_without_counting_free_blocks_runs_out(monkeypatch):
    monkeypatch.setattr(ContinuousBatcher, "_blocks_needed", lambda self, r, n: 0)
    with pytest.raises(ValueError, match="out of KV blocks"):
        ContinuousBatcher(MODEL, num_blocks=12, block_size=4, token_budget=16, max_running=4).run(
            trace(), lambda chunks: 1.0)


def test_latencies_of_a_trace_counted_by_hand():
    a, b = Request((1, 2, 3), 2), Request((4, 5, 6, 7, 8), 3)
    seen = []
    served = ContinuousBatcher(MODEL, num_blocks=16, block_size=4, token_budget=4, max_running=2).run(
        [a, b], lambda chunks: seen.append(chunks) or 1.0)
    # step 1: a's prompt (3) and b's first token (1); step 2: a decodes, b's next 3; step 3: b's last
    assert seen[:3] == [[Chunk(3, 3), Chunk(1, 1)], [Chunk(1, 4), Chunk(3, 4)], [Chunk(1, 5)]]
    assert [s.token_times for s in served] == [[1.0, 2.0], [3.0, 4.0, 5.0]]
    assert (served[0].ttft, served[1].ttft, served[1].tpot) == (1.0, 3.0, 1.0)
    assert latency_summary(served) == {"ttft": 2.0, "tpot": 1.0, "throughput": 1.0}
    seen.clear()
    static = static_batching([a, b], 2, lambda chunks: seen.append(chunks) or 1.0)
    assert seen == [[Chunk(5, 5)] * 2, [Chunk(1, 6)] * 2, [Chunk(1, 7)] * 2]  # padded to b's prompt
    assert [s.token_times for s in static] == [[1.0, 2.0], [1.0, 2.0, 3.0]]


def test_static_batches_wait_for_the_batch_before():
    early, late = Request((1,), 4, 0.0), Request((2,), 1, 0.5)
    static = static_batching([early, late], 2, lambda chunks: 1.0)
    assert static[1].token_times == [5.0]  # starts when the first batch's 4 steps end
    served = ContinuousBatcher(MODEL, 8, 4).run([early, late], lambda chunks: 1.0)
    assert served[1].token_times == [2.0]  # joins at the next step


def test_a_request_larger_than_the_pool_is_refused():
    with pytest.raises(ValueError, match="cannot be served"):
        ContinuousBatcher(MODEL, num_blocks=2, block_size=4).run([Request(tuple(range(9)), 1)], lambda c: 1.0)

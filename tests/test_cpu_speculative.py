"""Speculative decoding: the modified rejection rule leaves the target's distribution exactly (by enumeration
of every random branch on a small vocabulary), through paged caches that roll rejected drafts back."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mha_lab.cpu import speculative as sp
from mha_lab.cpu.paged import PagedKVCache
from mha_lab.cpu.speculative import (
    RandomDraw,
    enumerate_outcomes,
    expected_speedup,
    expected_tokens,
    plain_generate,
    speculative_generate,
    verify,
)
from mha_lab.cpu.tiny_lm import TinyLM
from mha_lab.testing import assert_close

TARGET = TinyLM(vocab=3, d_model=8, num_heads=2, num_kv_heads=1, max_len=16, seed=3)
DRAFT = TARGET.perturbed(0.5, seed=4)
PROMPT = [0, 2, 1]


def one_step_distribution(p, q, k):
    """The first token out of one speculative step whose drafts are drawn from q, as exact probabilities."""
    def run(draw):
        drafted = [draw.sample(q[i]) for i in range(k)]
        return verify(p, q, drafted, draw)[0]

    dist = enumerate_outcomes(run)
    return np.array([dist.get(x, 0.0) for x in range(p.shape[1])])


def random_rows(rng, n, V):
    x = rng.random((n, V)) ** 3
    return x / x.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_first_token_is_distributed_as_the_target(k):
    rng = np.random.default_rng(k)
    p, q = random_rows(rng, k + 1, 5), random_rows(rng, k, 5)
    np.testing.assert_allclose(one_step_distribution(p, q, k), p[0], rtol=1e-12, atol=1e-15)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 2), st.integers(2, 4), st.integers(0, 2**16))
def test_any_draft_leaves_the_target_distribution(k, V, seed):
    rng = np.random.default_rng(seed)
    p, q = random_rows(rng, k + 1, V), random_rows(rng, k, V)
    np.testing.assert_allclose(one_step_distribution(p, q, k), p[0], rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize(("bug", "replacement"), [
    ("acceptance_probability", lambda p, q, x: float(min(1.0, q[x] / p[x]))),  # the ratio upside down
    ("residual", lambda p, q: p),  # resampling from the target instead of the residual
])
def test_a_wrong_rule_changes_the_distribution(monkeypatch, bug, replacement):
    rng = np.random.default_rng(0)
    p, q = random_rows(rng, 2, 5), random_rows(rng, 1, 5)
    monkeypatch.setattr(sp, bug, replacement)
    assert np.abs(one_step_distribution(p, q, 1) - p[0]).max() > 1e-3


def model_distributions(k, n=2):
    want = enumerate_outcomes(lambda draw: tuple(plain_generate(TARGET, PROMPT, n, draw)))
    got = enumerate_outcomes(lambda draw: tuple(speculative_generate(TARGET, DRAFT, PROMPT, n, k, draw,
                                                                     num_blocks=8)[0]))
    return want, got


@pytest.mark.parametrize("k", [1, 2])
def test_speculative_sampling_is_the_targets_distribution(k):
    want, got = model_distributions(k)
    assert set(got) <= set(want) and len(want) == 9
    for seq, prob in want.items():
        assert got.get(seq, 0.0) == pytest.approx(prob, rel=1e-10, abs=1e-15), seq


def rejected_then_replaced(cache_bug=None):
    """Score 3 drafts after a prompt, keep the first, replace the second: logits of the replacement and plain's."""
    model = TinyLM(vocab=16, seed=7)
    cache = PagedKVCache.for_layer(model.layer, num_blocks=8, block_size=4)
    seq = cache.add_sequence()
    prompt, drafts = [3, 1, 4, 1, 5], [9, 2, 6]
    model.step(cache, {seq: prompt + drafts})
    cache.truncate(seq, len(prompt) + 1) if cache_bug is None else cache_bug(cache, seq)
    got = model.step(cache, {seq: [7]})[seq][-1]
    return got, model.forward(np.array([prompt + [9, 7]]))[0, -1]


def test_a_rolled_back_cache_continues_as_if_the_drafts_never_were():
    got, want = rejected_then_replaced()
    assert_close(got, want)


def test_forgetting_to_roll_back_the_cache_is_caught(monkeypatch):
    got, want = rejected_then_replaced(cache_bug=lambda cache, seq: None)
    assert not np.allclose(got, want)  # the replacement attends to the rejected drafts
    monkeypatch.setattr(PagedKVCache, "truncate", lambda self, seq, length: None)
    with pytest.raises(ValueError, match="drafted tokens need"):  # the next round scores too few positions
        model_distributions(1)


def test_rolled_back_caches_hold_exactly_the_kept_tokens(monkeypatch):
    seen = []
    step = TinyLM.step

    def spy(model, cache, work):
        out = step(model, cache, work)
        seen.append((model, cache, next(iter(work))))
        return out

    monkeypatch.setattr(TinyLM, "step", spy)
    target = TinyLM(vocab=16, seed=5)
    tokens, stats = speculative_generate(target, target.perturbed(0.3), [1, 2, 3], 12, 3, RandomDraw(1))
    model, cache, seq = next(s for s in reversed(seen) if s[0] is target)
    assert cache.lengths[seq] == 3 + stats.tokens - 1  # every token kept but the last one out
    K, _ = cache.gather(seq)
    _, K_plain, _ = target.layer.project_qkv(target.E[[1, 2, 3] + tokens][None] + target.P[:15])
    np.testing.assert_allclose(K[:, :14], K_plain[0, :, :14], rtol=1e-10, atol=1e-12)
    assert stats.rounds < 12 and stats.tokens >= 12


def test_a_draft_equal_to_the_target_is_always_accepted():
    model = TinyLM(vocab=16, seed=6)
    _, stats = speculative_generate(model, model, [4, 5], 20, 4, RandomDraw(2))
    assert stats.acceptance_rate == 1.0 and stats.rounds == 4 and stats.tokens == 20


def test_expected_tokens_and_speedup():
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_speedup(0.8, 4, 0.0) == pytest.approx((1 - 0.8**5) / 0.2)
    assert expected_speedup(0.8, 4, 0.25) == pytest.approx((1 - 0.8**5) / 0.2 / 2)


def test_mismatched_drafts_are_an_error():
    with pytest.raises(ValueError, match="k\\+1"):
        verify(np.ones((2, 3)) / 3, np.ones((2, 3)) / 3, [0, 1], RandomDraw())


def test_uniform_draws_reproduce_the_targets_law_on_a_grid():
    """UniformDraw on every cell of a grid of (u, r): the first token out is distributed as the target's p."""
    p, q = np.array([0.1, 0.2, 0.7]), np.array([0.6, 0.3, 0.1])
    grid = (np.arange(200) + 0.5) / 200
    law = np.zeros(3)
    for x in range(3):
        for u in grid:
            for r in grid[::10]:
                law[verify(p[None].repeat(2, 0), q[None], [x], sp.UniformDraw([u], r))[0]] += q[x] / 200 / 20
    np.testing.assert_allclose(law, p, atol=0.03)
    draw = sp.UniformDraw([0.5, 0.9], 0.25)
    assert draw.accept(0.6) and not draw.accept(0.6) and draw.coins == 2
    assert draw.sample(np.array([0.2, 0.1, 0.7])) == 1 and sp.UniformDraw([], 0.999).sample(np.ones(2) / 2) == 1

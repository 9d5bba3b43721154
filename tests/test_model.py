"""The course's language model: its weights come from its code, and its evaluation cores equal plain caches.

The cores of ``mha_lab.model.caches`` give every query of one forward pass what a streaming
cache would hold; here each is checked against such a cache written plainly, token by token.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from mha_lab.cpu.positions import apply_rope
from mha_lab.cpu.rope_scaling import interpolation_frequencies, rope_frequencies
from mha_lab.model import MEASUREMENTS, WEIGHTS, corpus
from mha_lab.model.caches import kivi_core, kivi_masks, streaming_core
from mha_lab.model.evaluate import attention_to_first, perplexity, recompute_nll, token_nll
from mha_lab.model.train import PRETRAIN, VARIANTS, load, pretrain, sha256, validation_loss
from mha_lab.model.transformer import BOS, ByteLM, Config, Rope, causal_core, eager_core, pool_kv_heads, rotate

SMALL = Config(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, train_len=24)


def _log(name: str) -> dict:
    return json.loads((WEIGHTS / f"{name}.json").read_text())


# --------------------------------------------------------------------------------------------
# The weights come from the code
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant, steps", [("base", 3), ("sink-logit", 2)])
def test_replaying_the_first_steps_gives_the_logged_losses(variant, steps):
    log = _log(variant)
    assert log["corpus_sha256"] == corpus.digest(), "the corpus is not the one the weights were trained on"
    assert log["recipe"] == PRETRAIN and log["config"] == VARIANTS[variant].as_dict()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the run was: one thread sums in one order
    try:
        _, losses = pretrain(VARIANTS[variant], **{**PRETRAIN, "steps": steps})
    finally:
        torch.set_num_threads(threads)
    # another CPU's kernels may order float32 sums differently: agree to 1e-4 relative (here: to the digit)
    np.testing.assert_allclose(losses, log["losses"][:steps], rtol=1e-4)


def test_every_stored_weight_file_has_its_logged_sha256():
    logs = sorted(WEIGHTS.glob("*.json"))
    assert {p.stem for p in logs} >= {"base", "sink-logit"}
    for path in logs:
        log = json.loads(path.read_text())
        assert sha256(WEIGHTS / log["weights"]) == log["sha256"], f"{log['weights']} is not what training wrote"


def test_the_logged_validation_loss_is_what_the_stored_base_model_scores():
    # the log scored the float32 weights; their float16 copies move the loss by well under 0.01 nats
    assert validation_loss(load("base")) == pytest.approx(_log("base")["valid_loss"], abs=0.01)


# --------------------------------------------------------------------------------------------
# The model's parts
# --------------------------------------------------------------------------------------------

def test_rotate_is_the_books_rope_in_the_half_layout():
    x = np.random.default_rng(0).standard_normal((1, 2, 7, 8))
    got = rotate(torch.from_numpy(x), torch.arange(7), torch.from_numpy(rope_frequencies(8)))
    np.testing.assert_allclose(got.numpy(), apply_rope(x, np.arange(7), layout="half"), rtol=1e-10, atol=1e-12)


def test_position_interpolation_rotates_position_p_as_plain_rope_rotates_p_over_s():
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((1, 1, 9, 16)))
    pi = Rope.scaled("pi", 16, 4, 24)
    plain = Rope.plain(16)
    torch.testing.assert_close(rotate(x, torch.arange(9), pi.freqs), rotate(x, torch.arange(9) / 4, plain.freqs))
    np.testing.assert_array_equal(pi.freqs.numpy(), interpolation_frequencies(16, 4))


@pytest.mark.parametrize("sink_logit", [False, True])
def test_the_training_core_equals_the_eager_core(sink_logit):
    torch.manual_seed(0)
    model = ByteLM(Config(**{**SMALL.as_dict(), "sink_logit": sink_logit})).double()
    if sink_logit:
        with torch.no_grad():
            for block in model.blocks:
                block.sink_logits.copy_(torch.tensor([-2.0, 0.0, 1.0, 3.0]))
    tokens = torch.randint(0, 257, (2, 19))
    torch.testing.assert_close(model(tokens, core=causal_core), model(tokens, core=eager_core))


def test_pooling_heads_that_are_already_equal_changes_nothing():
    """Adjacent heads pool (0 and 1, 2 and 3): pooling the wrong pairs would change the output."""
    torch.manual_seed(0)
    model = ByteLM(Config(**{**SMALL.as_dict(), "num_kv_heads": 4})).eval()
    with torch.no_grad():
        for block in model.blocks:
            for W in (block.attn.W_K, block.attn.W_V):  # (d_model, 4 heads * 8)
                W[:, 8:16], W[:, 24:32] = W[:, 0:8], W[:, 16:24]
    tokens = torch.randint(0, 257, (1, 13))
    pooled = pool_kv_heads(model, 2)
    assert pooled.cfg.num_kv_heads == 2
    torch.testing.assert_close(pooled(tokens), model(tokens), rtol=1e-5, atol=1e-5)
    assert (pool_kv_heads(model, 1)(tokens) - model(tokens)).abs().max() > 1e-3
    with pytest.raises(ValueError, match="pooled evenly"):
        pool_kv_heads(model, 3)


# --------------------------------------------------------------------------------------------
# Caches: one forward pass against a plain cache filled token by token
# --------------------------------------------------------------------------------------------

def _qkv(L: int, seed: int = 0, d: int = 8) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, L, d, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, L, d, generator=g, dtype=torch.float64)
    v = torch.randn(1, 1, L, d, generator=g, dtype=torch.float64)
    return q, k, v


def _attend_one(q_t: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One query (h, d) over cached keys and values (n, d) shared by every head."""
    return torch.softmax(q_t @ keys.T / math.sqrt(q_t.shape[-1]), dim=-1) @ values


def _streaming_reference(q, k, v, freqs, window, sinks, renumber=True):
    """A StreamingLLM cache, token by token: keep sinks and the last ``window``; rotate at cache positions."""
    L, out = q.shape[2], torch.zeros_like(q)
    for t in range(L):
        kept = [j for j in range(t + 1) if j < sinks or t - j < window]
        pos = torch.arange(len(kept)) if renumber else torch.tensor(kept)
        keys = rotate(k[0, 0, kept][None, None], pos, freqs)[0, 0]
        q_t = rotate(q[0, :, t:t + 1][None], pos[-1:], freqs)[0, :, 0]
        out[0, :, t] = _attend_one(q_t, keys, v[0, 0, kept])
    return out


@pytest.mark.parametrize("window, sinks", [(5, 0), (5, 2), (1, 3), (30, 4)])
def test_the_streaming_core_is_a_token_by_token_sink_cache(window, sinks):
    q, k, v = _qkv(23)
    rope = Rope.plain(8)
    pos = torch.arange(23)
    got = streaming_core(window, sinks)(rotate(q, pos, rope.freqs), rotate(k, pos, rope.freqs), v, None, rope=rope)
    torch.testing.assert_close(got, _streaming_reference(q, k, v, rope.freqs, window, sinks))


def test_a_sink_kept_at_its_absolute_position_is_not_streamingllms_cache():
    """The bug this catches: keeping the sinks but not renumbering their positions."""
    q, k, v = _qkv(23)
    rope = Rope.plain(8)
    pos = torch.arange(23)
    got = streaming_core(5, 2)(rotate(q, pos, rope.freqs), rotate(k, pos, rope.freqs), v, None, rope=rope)
    absolute = _streaming_reference(q, k, v, rope.freqs, 5, 2, renumber=False)
    assert (got - absolute).abs().max() > 1e-3


def _minmax(x: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Asymmetric quantisation, a scale and zero point along ``axis``, written out plainly."""
    lo, hi = x.min(axis=axis, keepdims=True), x.max(axis=axis, keepdims=True)
    scale = np.where(hi > lo, (hi - lo) / (2 ** bits - 1), 1.0)
    return np.round((x - lo) / scale) * scale + lo


class _KiviCache:
    """KIVI's cache as its Algorithm 1 runs it: keys wait in the residual until ``residual`` of them have
    arrived, then are quantised per channel, ``group`` tokens at a time; a value is quantised per token
    (here ``group`` = the head size: one group) as it leaves the newest ``residual``."""

    def __init__(self, bits: int, group: int, residual: int, per_channel: bool = True) -> None:
        self.bits, self.group, self.residual, self.per_channel = bits, group, residual, per_channel
        self.k_quant, self.k_resid, self.v_quant, self.v_resid = [], [], [], []

    def append(self, k_t: np.ndarray, v_t: np.ndarray) -> None:
        self.k_resid.append(k_t)
        if len(self.k_resid) == self.residual:
            for i in range(0, self.residual, self.group):
                block = np.stack(self.k_resid[i:i + self.group])  # (G, d)
                self.k_quant += list(_minmax(block, self.bits, axis=0 if self.per_channel else 1))
            self.k_resid = []
        self.v_resid.append(v_t)
        if len(self.v_resid) > self.residual:
            self.v_quant.append(_minmax(self.v_resid.pop(0), self.bits, axis=0))

    def keys(self) -> np.ndarray:
        return np.stack(self.k_quant + self.k_resid)

    def values(self) -> np.ndarray:
        return np.stack(self.v_quant + self.v_resid)


def _kivi_reference(q, k, v, bits, group, residual, per_channel=True):
    cache, out = _KiviCache(bits, group, residual, per_channel), torch.zeros_like(q)
    for t in range(q.shape[2]):
        cache.append(k[0, 0, t].numpy(), v[0, 0, t].numpy())
        out[0, :, t] = _attend_one(q[0, :, t], torch.from_numpy(cache.keys()), torch.from_numpy(cache.values()))
    return out


@pytest.mark.parametrize("bits, group, residual", [(2, 4, 4), (4, 2, 6), (2, 8, 8), (2, 3, 9)])
def test_the_kivi_core_is_kivis_streaming_cache(bits, group, residual):
    q, k, v = _qkv(23, seed=2, d=group)  # values: one group of d channels per token
    got = kivi_core(bits, group, residual)(q, k, v, None)
    torch.testing.assert_close(got, _kivi_reference(q, k, v, bits, group, residual))


def test_kivi_quantises_keys_per_channel_and_keeps_an_incomplete_residual_exact():
    """The bugs this catches: per-token keys; quantising keys before the residual is full."""
    q, k, v = _qkv(23, seed=2, d=4)
    got = kivi_core(2, 4, 8)(q, k, v, None)
    assert (got - _kivi_reference(q, k, v, 2, 4, 8, per_channel=False)).abs().max() > 1e-3
    keys, values = kivi_masks(20, 8)
    assert keys[14, :8].all() and not keys[14, 8:].any()  # 8..14 wait for token 15
    assert keys[15, :16].all() and not keys[15, 16:].any()
    assert values[19, :12].all() and not values[19, 12:].any()  # the newest 8 values stay exact
    with pytest.raises(ValueError, match="multiple of the group"):
        kivi_core(2, 4, 6)


@pytest.mark.parametrize("start_token", [False, True])
def test_recomputation_predicts_each_token_from_the_last_window_alone(start_token):
    torch.manual_seed(0)
    model = ByteLM(SMALL).eval()
    tokens = np.random.default_rng(0).integers(0, 256, (2, 17))
    tokens[:, 0] = BOS
    W = 5
    got = recompute_nll(model, tokens, W, start_token=start_token)
    for t in range(1, 17):  # predicting token t from tokens max(0, t - W) .. t - 1
        context = tokens[:, max(0, t - W):t].copy()
        if start_token:
            context[:, 0] = BOS
        want = token_nll(model, np.concatenate([context, tokens[:, t:t + 1]], axis=1))[:, -1]
        np.testing.assert_allclose(got[:, t - 1], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(recompute_nll(model, tokens, 17), token_nll(model, tokens), rtol=1e-6)


# --------------------------------------------------------------------------------------------
# The committed measurements are the code's
# --------------------------------------------------------------------------------------------

def test_the_committed_measurements_recompute():
    stored = json.loads(MEASUREMENTS.read_text())
    ev = stored["eval"]
    base = load("base")
    at_train = corpus.long_documents(ev["docs"], ev["train_len"])
    first, _ = attention_to_first(base, at_train)
    np.testing.assert_allclose(first, stored["base"]["attention_to_first"], atol=2e-4)
    kivi = stored["base"]["quantized"][f"KIVI 2-bit, R = {ev['residuals'][-1]}"]
    recomputed = perplexity(token_nll(base, at_train, core=kivi_core(2, ev["group"], ev["residuals"][-1])))
    assert recomputed == pytest.approx(kivi["perplexity"], rel=1e-5)

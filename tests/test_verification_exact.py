"""Exact enumeration (float64, small vocabulary) of one step of speculative decoding through the engine's own
`engine.methods.sampling.verify_block`: the draft tokens are enumerated with their q-probability, and verify_block's
uniform and residual/bonus draws are enumerated exactly (tests/exact_draws.py). The emitted tokens must be
distributed exactly as the target would sample them."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from engine.methods import sampling
from engine.methods.sampling import accept_probability, logits_to_probs, verify_block

from .exact_draws import outcomes

V = 5


def toy_model(seed: int, peaky: float):
    """A deterministic 'language model' on V tokens: context tuple -> float64 distribution."""
    cache = {}

    def dist(ctx: tuple) -> torch.Tensor:
        if ctx not in cache:
            g = torch.Generator().manual_seed(hash((seed,) + ctx) % (2**31))
            logits = torch.randn(V, generator=g, dtype=torch.float64) * peaky
            cache[ctx] = logits.softmax(-1)
        return cache[ctx]

    return dist


def step_distribution(p, q, gamma: int, greedy: bool = False, bonus_row: bool = True):
    """Exact distribution of what one SD step emits (a tuple of 1..gamma+1 tokens; with no bonus row, as
    the parallel decoders call it, an all-accepted step emits just the gamma drafted tokens)."""
    out: dict[tuple, float] = {}
    for drafted in itertools.product(range(V), repeat=gamma):
        ctx, prob, q_rows, p_rows = (), 1.0, [], []
        for x in drafted:
            q_rows.append(q(ctx))
            p_rows.append(p(ctx))
            prob *= float(q(ctx)[x])
            ctx = ctx + (x,)
        if prob == 0:
            continue
        if bonus_row:
            p_rows.append(p(ctx))
        q_rows, p_rows = torch.stack(q_rows), torch.stack(p_rows)
        for v, pr in outcomes(lambda draws: verify_block(list(drafted), q_rows, p_rows, draws, greedy)):
            seq = drafted[: v.accepted] + (() if v.next_token is None else (v.next_token,))
            out[seq] = out.get(seq, 0.0) + prob * pr
    return out


def prefix_distribution(step: dict, p, length: int) -> dict:
    """P(first `length` output tokens = y), continuing short steps with exact target sampling."""
    dist: dict[tuple, float] = {}
    for seq, prob in step.items():
        if len(seq) >= length:
            dist[seq[:length]] = dist.get(seq[:length], 0.0) + prob
            continue
        for tail in itertools.product(range(V), repeat=length - len(seq)):
            full, pr = seq, prob
            for y in tail:
                pr *= float(p(full)[y])
                full = full + (y,)
            dist[full] = dist.get(full, 0.0) + pr
    return dist


def target_distribution(p, length: int) -> dict:
    out = {}
    for seq in itertools.product(range(V), repeat=length):
        pr, ctx = 1.0, ()
        for y in seq:
            pr *= float(p(ctx)[y])
            ctx = ctx + (y,)
        out[seq] = pr
    return out


def max_error(gamma, p, q, **how) -> float:
    step = step_distribution(p, q, gamma, **how)
    assert abs(sum(step.values()) - 1) < 1e-12
    got = prefix_distribution(step, p, gamma + 1)
    want = target_distribution(p, gamma + 1)
    return max(abs(got.get(k, 0.0) - v) for k, v in want.items())


PAIRS = [(1, 2, 1.0), (3, 4, 2.0), (5, 6, 0.3)]  # (target seed, draft seed, peakiness)


@pytest.mark.parametrize("gamma", [1, 2, 3])
@pytest.mark.parametrize("seeds", PAIRS)
@pytest.mark.parametrize("bonus_row", [True, False])
def test_sd_rule_is_exact(gamma, seeds, bonus_row):
    p, q = toy_model(seeds[0], seeds[2]), toy_model(seeds[1], seeds[2])
    assert max_error(gamma, p, q, bonus_row=bonus_row) < 1e-9


@pytest.mark.parametrize("gamma", [1, 3])
def test_sd_rule_exact_with_processed_distributions(gamma):
    """The rule stays exact when p and q are temperature/top-k/top-p processed (zeros in q)."""
    raw_p, raw_q = toy_model(7, 2.0), toy_model(8, 2.0)
    # logits_to_probs returns float32 rows; in float64 they are renormalised (off by ~1e-8 otherwise)
    p = lambda ctx: normalised(logits_to_probs(raw_p(ctx).log(), 0.7, top_k=4, top_p=0.9))  # noqa: E731
    q = lambda ctx: normalised(logits_to_probs(raw_q(ctx).log(), 1.3, top_k=3, top_p=0.8))  # noqa: E731
    assert max_error(gamma, p, q) < 1e-9


def normalised(row: torch.Tensor) -> torch.Tensor:
    row = row.double()
    return row / row.sum()


@pytest.mark.parametrize("greedy", [True, False])
def test_greedy_rule_is_exact(greedy):
    """One-hot rows (temperature 0), through the greedy branch and through the sampled rule alike."""
    raw_p, raw_q = toy_model(9, 1.0), toy_model(10, 1.0)
    p = lambda ctx: logits_to_probs(raw_p(ctx).log(), 0.0).double()  # noqa: E731
    q = lambda ctx: logits_to_probs(raw_q(ctx).log(), 0.0).double()  # noqa: E731
    assert max_error(3, p, q, greedy=greedy) < 1e-12


@pytest.mark.parametrize("wrong", ["residual_is_p", "accept_q_over_p", "residual_unnormalised_q"])
def test_negative_controls_fail(wrong, monkeypatch):
    """Deliberately wrong rules, patched into the engine's verify_block, must fail the same check."""
    p, q = toy_model(3, 2.0), toy_model(4, 2.0)
    name, rule = {
        "residual_is_p": ("residual_distribution", lambda pd, qd: pd),
        "accept_q_over_p": ("accept_probability", lambda pd, qd, x: accept_probability(qd, pd, x)),
        "residual_unnormalised_q": ("residual_distribution", lambda pd, qd: qd),
    }[wrong]
    monkeypatch.setattr(sampling, name, rule)
    assert max_error(2, p, q) > 1e-3


def test_top_p_keeps_smallest_covering_set():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0]).double()
    probs = logits.softmax(-1)
    got = logits_to_probs(logits, 1.0, top_p=0.8)
    order = torch.argsort(probs, descending=True)
    k = int((probs[order].cumsum(0) < 0.8).sum()) + 1
    keep = set(order[:k].tolist())
    assert {i for i in range(5) if got[i] > 0} == keep
    assert abs(float(got.sum()) - 1) < 1e-6
    kept = torch.tensor(sorted(keep))
    torch.testing.assert_close(got[kept].double(), probs[kept] / probs[kept].sum(), rtol=1e-5, atol=1e-6)


def test_random_pairs_many():
    rng = random.Random(0)
    for _ in range(5):
        a, b = rng.randrange(1000), rng.randrange(1000)
        assert max_error(2, toy_model(a, 1.5), toy_model(b, 1.5)) < 1e-9

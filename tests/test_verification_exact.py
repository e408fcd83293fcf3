"""Exact enumeration (float64, small vocabulary): one step of speculative decoding, verified with the
engine's own rule primitives, must emit tokens distributed exactly as the target would sample them."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from engine.sampling import accept_probability, logits_to_probs, residual_distribution

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


def step_distribution(p, q, gamma: int, accept=accept_probability, residual=residual_distribution):
    """Exact distribution of what one SD step emits (a tuple of 1..gamma+1 tokens)."""
    out: dict[tuple, float] = {}

    def walk(ctx: tuple, prob: float, i: int):
        if i == gamma:  # all accepted: bonus from p
            for y in range(V):
                out[ctx + (y,)] = out.get(ctx + (y,), 0.0) + prob * float(p(ctx)[y])
            return
        qd, pd = q(ctx), p(ctx)
        r = residual(pd, qd)
        for x in range(V):
            px = prob * float(qd[x])
            if px == 0:
                continue
            a = accept(pd, qd, x)
            walk(ctx + (x,), px * a, i + 1)
            for y in range(V):  # rejected: correction from the residual
                out[ctx + (y,)] = out.get(ctx + (y,), 0.0) + px * (1 - a) * float(r[y])

    walk((), 1.0, 0)
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


def max_error(gamma, p, q, **rule) -> float:
    step = step_distribution(p, q, gamma, **rule)
    assert abs(sum(step.values()) - 1) < 1e-12
    got = prefix_distribution(step, p, gamma + 1)
    want = target_distribution(p, gamma + 1)
    return max(abs(got.get(k, 0.0) - v) for k, v in want.items())


PAIRS = [(1, 2, 1.0), (3, 4, 2.0), (5, 6, 0.3)]  # (target seed, draft seed, peakiness)


@pytest.mark.parametrize("gamma", [1, 2, 3])
@pytest.mark.parametrize("seeds", PAIRS)
def test_sd_rule_is_exact(gamma, seeds):
    p, q = toy_model(seeds[0], seeds[2]), toy_model(seeds[1], seeds[2])
    assert max_error(gamma, p, q) < 1e-9


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


def test_greedy_rule_is_exact():
    raw_p, raw_q = toy_model(9, 1.0), toy_model(10, 1.0)
    p = lambda ctx: logits_to_probs(raw_p(ctx).log(), 0.0).double()  # noqa: E731
    q = lambda ctx: logits_to_probs(raw_q(ctx).log(), 0.0).double()  # noqa: E731
    assert max_error(3, p, q) < 1e-12


@pytest.mark.parametrize("wrong", ["residual_is_p", "accept_q_over_p", "residual_unnormalised_q"])
def test_negative_controls_fail(wrong):
    """Deliberately wrong rules must fail the same check, so the check has teeth."""
    p, q = toy_model(3, 2.0), toy_model(4, 2.0)
    rules = {
        "residual_is_p": dict(residual=lambda pd, qd: pd),
        "accept_q_over_p": dict(accept=lambda pd, qd, x: min(1.0, float(qd[x]) / float(pd[x]))),
        "residual_unnormalised_q": dict(residual=lambda pd, qd: qd),
    }[wrong]
    assert max_error(2, p, q, **rules) > 1e-3


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

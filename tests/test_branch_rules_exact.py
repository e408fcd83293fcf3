"""Exact enumeration (float64, V = 5, k up to 3) of the multi-candidate rules at a branch point, through the
engine's own `engine.methods.sampling.verify_candidates`: for each way of drawing the k candidates, every candidate
tuple is enumerated with its probability of being drawn, and verify_candidates' uniform and final-residual
draws are enumerated exactly (tests/exact_draws.py). The emitted token must be distributed exactly as p.
Negative controls: the three mistakes docs/specbranch.md lists, patched in, must each be badly biased."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.methods import sampling
from engine.methods.sampling import (
    IID,
    NO_REPLACEMENT,
    TOPK,
    candidate_step,
    draw_candidates,
    draw_u,
    logits_to_probs,
    sample,
    sample_at,
    verify_candidates,
)

from .exact_draws import outcomes

V = 5


def rand_dist(seed: int, peaky: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(V, generator=g, dtype=torch.float64) * peaky).softmax(-1)


def candidate_sets(q: torch.Tensor, k: int, scheme: str):
    """Every candidate tuple with its probability of being drawn (computed here, not by the engine)."""
    if scheme == TOPK:
        yield tuple(draw_candidates(q, k, TOPK, None)), 1.0
        return
    for cands in itertools.product(range(V), repeat=k):
        if scheme == NO_REPLACEMENT and len(set(cands)) < k:
            continue
        prob = 1.0
        for i, x in enumerate(cands):
            left = 1.0 - sum(float(q[c]) for c in cands[:i]) if scheme == NO_REPLACEMENT else 1.0
            prob *= float(q[x]) / left
        if prob > 0:
            yield cands, prob


def output_distribution(p, q, k, scheme, greedy=False, order=lambda c, q: c):
    out = torch.zeros(V, dtype=torch.float64)
    for cands, pc in candidate_sets(q, k, scheme):
        cands = list(order(cands, q))
        for v, pr in outcomes(lambda draws: verify_candidates(p, q, cands, scheme, draws, greedy)):
            out[v.token] += pc * pr
    return out


CASES = [(1, 2), (3, 4), (5, 6), (7, 8)]


@pytest.mark.parametrize("scheme", [TOPK, IID, NO_REPLACEMENT])
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("seeds", CASES)
def test_rule_is_exact(scheme, k, seeds):
    p, q = rand_dist(seeds[0]), rand_dist(seeds[1])
    assert float((output_distribution(p, q, k, scheme) - p).abs().max()) < 1e-9


@pytest.mark.parametrize("scheme", [TOPK, IID, NO_REPLACEMENT])
def test_rule_is_exact_with_truncated_rows(scheme):
    """Zeros in q (top-k/top-p) and in p: still exact."""

    def row(seed, t, top_k, top_p):
        r = logits_to_probs(rand_dist(seed).log(), t, top_k, top_p).double()
        return r / r.sum()

    p, q = row(11, 0.8, 4, 0.95), row(12, 1.2, 0, 0.7)
    k = min(3, int((q > 0).sum()))
    assert float((output_distribution(p, q, k, scheme) - p).abs().max()) < 1e-9


@pytest.mark.parametrize("greedy", [True, False])
def test_greedy_topk_follows_target_argmax(greedy):
    p = logits_to_probs(rand_dist(1).log(), 0.0).double()
    for seed in range(2, 12):  # the target's argmax among the candidates, first or later, or not at all
        assert torch.equal(output_distribution(p, rand_dist(seed), 3, TOPK, greedy), p)


def tv(a, b) -> float:
    return 0.5 * float((a - b).abs().sum())


def test_negative_control_draft_ratio_for_topk(monkeypatch):
    """Mistake 1: verifying deterministic top-k candidates with the p/q ratio."""
    p, q = rand_dist(3, 2.5), rand_dist(4, 2.5)
    monkeypatch.setattr(sampling, "candidate_step", lambda p_i, q_i, x, s: candidate_step(p_i, q_i, x, IID))
    assert tv(output_distribution(p, q, 3, TOPK), p) > 0.3


def test_negative_control_unadjusted_q_without_replacement(monkeypatch):
    """Mistake 2: drawing without replacement but leaving q unadjusted in the rule."""
    p, q = rand_dist(5, 2.5), rand_dist(6, 2.5)
    monkeypatch.setattr(sampling, "candidate_q", lambda q, earlier, s: q)
    assert tv(output_distribution(p, q, 3, NO_REPLACEMENT), p) > 0.2


def test_negative_control_resorting_candidates():
    """Mistake 3: re-sorting sampled candidates (by q) before verifying them."""
    p, q = rand_dist(7, 2.5), rand_dist(8, 2.5)
    resort = lambda c, q: tuple(sorted(c, key=lambda x: -float(q[x])))  # noqa: E731
    assert tv(output_distribution(p, q, 3, NO_REPLACEMENT, order=resort), p) > 0.1


@pytest.mark.parametrize("scheme", [IID, NO_REPLACEMENT])
def test_engine_draws_candidates_with_the_enumerated_probabilities(scheme):
    """The engine's own draws (sampling.sample, by inverse CDF, and draw_candidates on it) follow the probabilities
    the enumeration above gives each candidate pair; a token of mass 0 is never drawn. Chi-square on 20,000 draws
    with a fixed seed, and a negative control: the same draws read as the other scheme's probabilities."""
    from scipy.stats import chisquare

    q = rand_dist(3)
    q[4] = 0.0
    q = q / q.sum()
    g, n = torch.Generator().manual_seed(0), 20000
    counts: dict = {}
    for _ in range(n):
        key = tuple(draw_candidates(q, 2, scheme, g))
        counts[key] = counts.get(key, 0) + 1
    assert all(4 not in key for key in counts)

    def pvalue(expected_scheme):
        expected = dict(candidate_sets(q, 2, expected_scheme))
        keys = sorted(set(expected) | set(counts))
        return chisquare([counts.get(k, 0) for k in keys], [expected.get(k, 1e-12) * n for k in keys]).pvalue

    assert pvalue(scheme) > 1e-3
    assert pvalue(IID if scheme == NO_REPLACEMENT else NO_REPLACEMENT) < 1e-6


def test_the_token_the_drafts_process_steps_ahead_on_is_the_draws_own():
    """NextDraw.guess, read from a row of logits in the draft's process, is the token the engine's draw picks from
    the same row: greedy, torch's argmax (the first of tied largest values); sampled, sample_at at its uniform on the
    row through the same settings."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(100, 50, generator=g)
    rows[:, 30] = rows[:, 7] = rows.max(-1).values + 1.0  # a tie for the largest: the first index is torch's
    for row in rows:
        assert sampling.NextDraw(0.0, 0, 1.0).guess(row) == int(row.argmax()) == 7
    for temperature, top_k, top_p in ((1.0, 0, 1.0), (0.8, 10, 0.9)):
        for row in torch.randn(200, 50, generator=g):
            draw = sampling.NextDraw(temperature, top_k, top_p, draw_u(g))
            assert draw.guess(row) == sample_at(logits_to_probs(row, temperature, top_k, top_p), draw.u)


def test_a_draw_fixed_before_its_row_is_the_inverse_cdf_at_its_uniform():
    """sample_at(q, u) is token i for u in [CDF(i-1), CDF(i)) (read 1e-9 inside each bound; a token of mass 0 has an
    empty interval, a one-hot row gives its token at any u), and sample(q, g) is sample_at at the uniform g draws next:
    a draw fixed before the draft's row is seen (sampling.NextDraw) has the probabilities of one drawn after it."""
    q = rand_dist(3)
    q[2] = 0.0
    q = (q / q.sum()).float()
    cdf = (q.double().cumsum(-1) / q.double().sum()).tolist()
    lo = 0.0
    for i, hi in enumerate(cdf):
        if hi > lo:
            for u in (lo + 1e-9, (lo + hi) / 2, hi - 1e-9):
                assert sample_at(q, u) == i
        else:
            assert i == 2  # mass 0: no u gives it
        lo = hi
    assert sample_at(torch.nn.functional.one_hot(torch.tensor(4), 6).float(), 0.999) == 4
    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        ahead = torch.Generator()
        ahead.set_state(g.get_state())
        assert sample(q, g) == sample_at(q, draw_u(ahead))

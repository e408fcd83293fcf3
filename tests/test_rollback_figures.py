"""The two rollback figures (engine.measure.metrics.draft_waste), by hand on constructed event streams, then on
real runs of the tiny models. Token ids: 1x linear drafts, 2x target tokens, 3x candidates, 4x/5x branch steps."""

from __future__ import annotations

import pytest

from app.views import metric_panel
from engine.config import GenerationConfig
from engine.events import (
    ACCEPTED,
    BONUS,
    CORRECTION,
    RESCUED,
    BranchResolved,
    DraftProposed,
    Finished,
    Rollback,
    StepStarted,
    TokensEmitted,
    Verified,
)
from engine.measure.metrics import compute_metrics, metrics_of
from sessions.replay import events_up_to_step, replay_steps


def path(step, *tokens):
    return DraftProposed(step, list(tokens), [""] * len(tokens), [0.5] * len(tokens))


def candidates(step, *tokens):
    return DraftProposed(step, list(tokens), [""] * len(tokens), [0.3] * len(tokens), kind="candidates")


def branch_step(step, *tokens):
    """One batched branch step: token i extends branch i + 1."""
    return [DraftProposed(step, [t], [""], [0.5], branch=i + 1, kind="branch") for i, t in enumerate(tokens)]


def verified(step, tokens, accepted, next_token=-1, next_kind=""):
    n = len(tokens)
    return Verified(step, n, accepted, [0.5] * n, [0.5] * n, [0.1] * n, next_token, next_kind, 0.5, tokens=tokens)


def resolved(step, cands, branches, survivor, token):
    return BranchResolved(
        step,
        0,
        cands,
        [""] * len(cands),
        [0.3] * len(cands),
        [0.3] * len(cands),
        [0.9] * len(cands),
        "without_replacement",
        branches,
        [[""] * len(b) for b in branches],
        survivor,
        token,
        survivor > 0,
    )


def dropped(step, reason, *tokens):
    return Rollback(step, "draft", list(tokens), [""] * len(tokens), reason)


def emitted(step, tokens, kinds):
    return TokensEmitted(step, tokens, [""] * len(tokens), kinds, "")


def finished():
    return Finished("length", 0.0, 1.0, 0, {})


def figures(events):
    m = compute_metrics(events)
    return m["path_rollback_rate"], m["wasted_draft_rate"]


def test_linear_rejection():
    events = [
        StepStarted(1, 3, 0.0),
        path(1, 10, 11, 12),
        verified(1, [10, 11, 12], 1, 20, CORRECTION),
        dropped(1, "rejected", 11, 12),
        emitted(1, [10, 20], [ACCEPTED, CORRECTION]),
        StepStarted(2, 5, 0.1),
        path(2, 13, 14, 15),
        verified(2, [13, 14, 15], 3, 21, BONUS),
        emitted(2, [13, 14, 15, 21], [ACCEPTED] * 3 + [BONUS]),
        finished(),
    ]
    # drafted 6, committed 4 (10, 13, 14, 15), no branch point: both 2/6
    assert figures(events) == (round(2 / 6, 6), round(2 / 6, 6))


def fork_second_wins():
    return [
        StepStarted(1, 3, 0.0),
        path(1, 10),
        candidates(1, 30, 31, 32),
        *branch_step(1, 40, 41, 42),
        *branch_step(1, 50, 51, 52),
        verified(1, [10], 1),
        resolved(1, [30, 31, 32], [[40, 50], [41, 51], [42, 52]], 1, 31),
        dropped(1, "losing branches", 30, 40, 50, 32, 42, 52),
        emitted(1, [10, 31], [ACCEPTED, RESCUED]),
    ]


def test_fork_whose_second_candidate_wins():
    events = fork_second_wins() + [
        # the surviving branch [41, 51] is the path now, and the draft added 60 after it
        StepStarted(2, 5, 0.1),
        path(2, 60),
        verified(2, [41, 51, 60], 1, 22, CORRECTION),
        dropped(2, "rejected", 51, 60),
        emitted(2, [41, 22], [ACCEPTED, CORRECTION]),
        finished(),
    ]
    # drafted 1 + 3 candidates + 6 branch tokens + 1 = 11; committed 10, 31, 41 = 3
    # path: 10, 31, 41, 51, 60 = 5 drafted, 2 of them (51, 60) discarded -> 2/5
    # hedge: 30, 40, 50, 32, 42, 52 = 6; wasted (11 - 3) / 11
    assert figures(events) == (0.4, round(8 / 11, 6))


def test_fork_where_all_candidates_lose():
    events = [
        StepStarted(1, 3, 0.0),
        path(1, 10),
        candidates(1, 30, 31),
        *branch_step(1, 40, 41),
        verified(1, [10], 1),
        resolved(1, [30, 31], [[40], [41]], -1, 25),
        dropped(1, "all branches rejected", 30, 40, 31, 41),
        emitted(1, [10, 25], [ACCEPTED, CORRECTION]),
        finished(),
    ]
    # drafted 5, committed 1 (10); no survivor: the path takes the first choice 30 and its branch 40
    # path: 10, 30, 40 -> 2/3 discarded; hedge 31, 41; wasted 4/5
    assert figures(events) == (round(2 / 3, 6), 0.8)


def test_superseded_by_a_bonus_token():
    events = [
        StepStarted(1, 3, 0.0),
        path(1, 10, 11),
        verified(1, [10], 1, 26, BONUS),
        dropped(1, "superseded", 11),
        emitted(1, [10, 26], [ACCEPTED, BONUS]),
        finished(),
    ]
    # drafted 2, committed 1; 11 was drafted on the path and discarded: 1/2 both
    assert figures(events) == (0.5, 0.5)


def test_fork_dropped_unverified_by_an_earlier_rejection():
    events = [
        StepStarted(1, 3, 0.0),
        path(1, 10, 11),
        candidates(1, 30, 31, 32),
        *branch_step(1, 40, 41, 42),
        verified(1, [10, 11], 1, 27, CORRECTION),
        dropped(1, "rejected", 11, 30, 40, 31, 41, 32, 42),
        emitted(1, [10, 27], [ACCEPTED, CORRECTION]),
        finished(),
    ]
    # drafted 8, committed 1; the unresolved branch point's path is the first choice: 10, 11, 30, 40
    # path 3/4 (11, 30, 40 after the rejection); hedge 31, 41, 32, 42; wasted 7/8
    assert figures(events) == (0.75, 0.875)


def test_pending_tokens_wait_for_their_fate_until_the_run_ends():
    events = fork_second_wins()  # the surviving branch 41, 51 is still pending
    # so far: settled 10 - 2 pending = 8, committed 2 (10, 31); path 10, 31: 0/2; wasted 6/8
    assert figures(events) == (0.0, 0.75)
    # the run ends there: 41, 51 were never committed. path 10, 31, 41, 51: 2/4; wasted 8/10
    assert figures(events + [finished()]) == (0.5, 0.8)
    pending_fork = [
        StepStarted(1, 3, 0.0),
        path(1, 10, 11),
        candidates(1, 30, 31),
        *branch_step(1, 40, 41),
        verified(1, [10], 1),
        emitted(1, [10], [ACCEPTED]),
    ]
    # 11, 30, 40, 31, 41 pending: only 10 has a fate (committed)
    assert figures(pending_fork) == (0.0, 0.0)
    # ended: path 10, 11, 30, 40 (first choice) -> 3/4; wasted 5/6
    assert figures(pending_fork + [finished()]) == (0.75, round(5 / 6, 6))


def test_old_stored_run_shows_both_figures():
    """A run stored before the split has only `rollback_rate` in its Finished metrics: replay computes both."""
    events = [
        StepStarted(1, 3, 0.0),
        path(1, 10),
        candidates(1, 30, 31),
        *branch_step(1, 40, 41),
        verified(1, [10], 1),
        resolved(1, [30, 31], [[40], [41]], -1, 25),
        dropped(1, "all branches rejected", 30, 40, 31, 41),
        emitted(1, [10, 25], [ACCEPTED, CORRECTION]),
        Finished("length", 0.0, 1.0, 2, {"tokens_per_s": 2.0, "rollback_rate": 0.8}),
    ]
    m = metrics_of(events)
    assert m["tokens_per_s"] == 2.0 and m["rollback_rate"] == 0.8  # what live showed is kept
    assert (m["path_rollback_rate"], m["wasted_draft_rate"]) == (round(2 / 3, 6), 0.8)
    panel = metric_panel(events)
    assert "path rollback rate</td><td class='num'>0.667" in panel
    assert "wasted draft rate</td><td class='num'>0.8" in panel
    assert "losing branches" in panel and "hedge" in panel


@pytest.mark.parametrize(
    "method,extra",
    [("sd", {}), ("pearl", {}), ("specbranch", {"epsilon": 0.9}), ("specbranch", {"epsilon": 0.9, "temperature": 0.0})],
)
def test_engine_runs(tiny_engine, method, extra):
    cfg = {"max_new_tokens": 40, "temperature": 1.0, "gamma": 3, "hrad": False, **extra}
    for seed in range(3):
        r = tiny_engine.run([2, 3, 4], GenerationConfig(method=method, seed=seed, **cfg))
        m = r.metrics
        assert 0 <= m["path_rollback_rate"] <= m["wasted_draft_rate"] <= 1
        discarded = sum(len(e.tokens) for e in r.events if isinstance(e, Rollback) and e.model == "draft")
        assert discarded <= m["wasted_draft_tokens"] <= m["drafted_tokens"]
        if method == "specbranch":
            assert m["branch_points"] > 0 and m["path_drafted_tokens"] < m["drafted_tokens"]
        else:  # no branch points: the two figures agree
            assert m["path_rollback_rate"] == m["wasted_draft_rate"]
            assert m["path_drafted_tokens"] == m["drafted_tokens"]
        for step in replay_steps(r.events):  # and at every step of a replay, mid-run
            path_rate, wasted = figures(events_up_to_step(r.events, step))
            if wasted is not None:
                assert 0 <= path_rate <= wasted <= 1

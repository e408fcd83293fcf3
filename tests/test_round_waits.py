"""docs/results/tools/round_waits.py: each round's waits on the draft, filed under how the previous verdict ended."""

from __future__ import annotations

from engine.events import BONUS, CORRECTION, BranchResolved, TimingSpan, Verified

from .scripts import load_script


def load_tool():
    return load_script("docs/results/tools/round_waits.py")


def span(worker: str, step: int, start: float, end: float, kind: str = "") -> TimingSpan:
    kind = kind or ("verify" if worker == "target" else "draft")
    return TimingSpan(worker=worker, kind=kind, step=step, start=start, end=end)


def verified(step: int, drafted: int, accepted: int) -> Verified:
    kind, nxt = (CORRECTION, 5) if accepted < drafted else (BONUS, 6)
    return Verified(step, drafted, accepted, [], [], [], nxt, kind, 1.0)


def fork(step: int, survivor: int) -> BranchResolved:
    return BranchResolved(
        step, 10, [1, 2, 3], [], [], [], [], "topk", [[], [], []], [], survivor, 1, rescued=survivor > 0
    )


def test_each_rounds_waits_go_under_the_verdict_before_it():
    tool = load_tool()
    events = [
        span("target", 0, 0.0, 0.05, "prefill"),  # not a round
        span("draft", 0, 0.0, 0.04, "prefill"),
        span("draft", 1, 0.05, 0.06),
        span("draft", 1, 0.06, 0.07),
        span("target", 1, 0.07, 0.12),
        span("draft", 1, 0.08, 0.09),  # beside the pass: not waited on
        verified(1, 2, 1),
        span("draft", 2, 0.12, 0.125),
        span("target", 2, 0.125, 0.17),
        verified(2, 2, 2),
        fork(2, 2),
        span("target", 3, 0.17, 0.2),
        verified(3, 0, 0),
        span("draft", 4, 0.2, 0.21),
        span("target", 4, 0.21, 0.25),
        verified(4, 3, 3),
        span("target", 5, 0.25, 0.3),
    ]
    got = [(last, n, round(ms, 6)) for last, n, ms in tool.rounds(events)]
    assert got == [
        ("start", 2, 20.0),
        ("path-rejected", 1, 5.0),
        ("fork-rescued", 0, 0.0),  # the fork's outcome wins over its path's verdict
        ("empty-pass", 1, 10.0),
        ("all-accepted", 0, 0.0),
    ]
    assert tool.outcome([verified(1, 3, 3), fork(1, 0)]) == "fork-first"
    assert tool.outcome([fork(1, -1)]) == "fork-none"

"""Which model sets a run's pace, and the headroom a run has if no drafted token were wasted
(engine.measure.metrics.round_pace), by hand on constructed event streams; the metric panel shows both."""

from __future__ import annotations

import pytest

from app.tabs.compare import comparison_table
from app.tabs.replay import compare_html
from app.views import metric_panel
from engine.events import ACCEPTED, CORRECTION, DraftProposed, Finished, Rollback, RunStarted, TimingSpan, TokensEmitted
from engine.measure.metrics import compute_metrics, round_pace
from sessions.replay import compare_runs


def stream(method: str, draft_ms: float, draft_steps: int = 4):
    """Two rounds: each one 60 ms target forward and `draft_steps` draft forwards of `draft_ms` (prefills before).
    8 tokens drafted, 6 committed and 2 rolled back: a wasted draft rate of 0.25."""
    events = [
        RunStarted(method, "t", "d", [1], "", {}, "cpu", 0.0),
        TimingSpan("target", "prefill", 0, 0.0, 0.01),
        TimingSpan("draft", "prefill", 0, 0.0, 0.005),
    ]
    t = 0.01
    for step, tokens in ((1, [10, 11, 12, 13]), (2, [14, 15, 16, 17])):
        events.append(TimingSpan("target", "verify", step, t, t + 0.06, 4))
        events += [
            TimingSpan("draft", "draft", step, t + i * draft_ms / 1000, t + (i + 1) * draft_ms / 1000)
            for i in range(draft_steps)
        ]
        events.append(DraftProposed(step, tokens, [""] * 4, [0.5] * 4))
        t += max(0.06, draft_steps * draft_ms / 1000)
    events += [
        TokensEmitted(1, [10, 11, 12, 13], [""] * 4, [ACCEPTED] * 4, ""),
        Rollback(2, "draft", [16, 17], ["", ""], "rejected"),
        TokensEmitted(2, [14, 15, 20], [""] * 3, [ACCEPTED, ACCEPTED, CORRECTION], ""),
        Finished("length", 0.01, t - 0.01, 7, {}),
    ]
    return events


def run(method: str, draft_ms: float, draft_steps: int = 4) -> dict:
    return compute_metrics(stream(method, draft_ms, draft_steps))


def test_pace_and_headroom_by_hand():
    # d · D = 4 steps × 20 ms = 80 ms > 60 ms: the draft sets the pace; without the 2 of 8 wasted steps a round
    # would last max(60, 60) ms: 80 / 60
    m = run("pearl", 20.0)
    assert m["wasted_draft_rate"] == 0.25 and m["draft_forward_ms"] == pytest.approx(20.0)
    assert m["pace"] == "draft" and m["no_waste_headroom"] == pytest.approx(80 / 60, abs=1e-4)
    # 4 × 10 ms = 40 ms < 60: the target sets it, and wasted draft steps cost nothing
    m = run("specbranch", 10.0)
    assert m["pace"] == "target" and m["no_waste_headroom"] == 1.0
    # SD runs them in turn: (60 + 80) / (60 + 60)
    m = run("sd", 20.0)
    assert m["pace"] == "serial" and m["no_waste_headroom"] == pytest.approx(140 / 120, abs=1e-4)
    # no draft forward: nothing to say
    m = run("ar", 20.0, draft_steps=0)
    assert m["pace"] is None and m["no_waste_headroom"] is None
    assert round_pace(None, 80.0, 0.25, False) == (None, None)


def test_the_metric_panel_shows_the_pace_with_its_formula():
    # a stored run that predates the metric (its Finished event carries none) shows it computed from its events
    html = metric_panel(stream("pearl", 20.0))
    assert "<td>pace</td><td class='num'>draft</td>" in html
    assert "<td>no waste headroom</td><td class='num'>1.33</td>" in html
    assert "the most that any branch or rollback policy could speed this run up" in html


def test_both_comparison_tables_show_each_runs_pace():
    runs = [stream("ar", 20.0, draft_steps=0), stream("pearl", 20.0), stream("specbranch", 10.0)]
    live = comparison_table(runs, greedy=False)  # Compare's table
    assert "<th>pace</th><th>no-waste headroom</th>" in live
    assert "<td>–</td><td>–</td>" in live  # ar: no draft
    assert "<td>draft</td><td>1.33</td>" in live and "<td>target</td><td>1</td>" in live
    stored = compare_html(compare_runs(runs))  # Replay's, with each value's difference from the first run
    assert "<th>pace</th><th>no_waste_headroom</th>" in stored
    assert "<td>draft</td><td>1.33</td>" in stored and "<td>target</td><td>1</td>" in stored

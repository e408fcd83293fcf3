"""The race (app/race.py) on constructed runs with a fake clock: columns reveal tokens at their measured
times from their own decode start, short races are slowed by one common factor, the identity check."""

from __future__ import annotations

import re

from app.navigator import clamp_step
from app.race import MIN_SECONDS, identical_check, race_frames
from engine.events import RunStarted, StepStarted, TimingSpan, TokensEmitted


def run(method: str, times: list[float], tokens: list[int], temperature: float = 0.0, prefill: float = 0.5):
    """A run whose prefill ends at `prefill` s and whose step i emits tokens[i] at prefill + times[i]."""
    events = [
        RunStarted(method, "t", "d", [1], "p", {"temperature": temperature}, "cpu", 0.0),
        TimingSpan("target", "prefill", 0, 0.0, prefill),
        TokensEmitted(0, [tokens[0]], ["x"], ["target"], "x"),
    ]
    for i, (t, token) in enumerate(zip(times, tokens[1:]), 1):
        events += [
            StepStarted(i, i, prefill + t - 0.01),
            TimingSpan("target", "decode", i, prefill + t - 0.01, prefill + t),
            TokensEmitted(i, [token], [f"<{token}>"], ["target"], ""),
        ]
    return events


def counts(frame: str) -> list[int]:
    return [int(n) for n in re.findall(r'class="race-count">(\d+)/\d+ tokens', frame)]


def test_columns_reveal_tokens_at_their_measured_times_on_one_clock():
    fast = run("sd", [0.1, 0.2], [1, 2, 3], prefill=2.0)  # a slow prefill does not count: decode starts at 0
    slow = run("ar", [0.2, 0.4], [1, 2, 3])
    now = [0.0]
    frames = list(race_frames([fast, slow], clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s)))
    stretch = MIN_SECONDS / 0.4  # the race is slowed to last MIN_SECONDS, both columns alike
    assert f"shown {stretch:.0f}× slower" in frames[0]
    seen = [counts(f) for f in frames]
    assert seen[0] == [1, 1] and seen[-1] == [3, 3]
    halfway = seen[round(0.25 * stretch * 10)]  # race time 0.25 s: sd is done, ar has its first decoded token
    assert halfway == [3, 2]
    assert 'data-done="true"' in frames[-1] and frames[-1].index("1st") < frames[-1].index("2nd")
    assert all(a[0] <= b[0] and a[1] <= b[1] for a, b in zip(seen, seen[1:]))  # text only grows
    assert "&lt;2&gt;" in frames[-1] and "<2>" not in frames[-1]  # token text is escaped


def test_identity_check():
    same = identical_check([run("ar", [0.1], [1, 2]), run("sd", [0.1], [1, 2])])
    assert "identical output at temperature 0" in same and "same 2 tokens" in same
    differ = identical_check([run("ar", [0.1], [1, 2]), run("sd", [0.1], [1, 3])])
    assert "sd departs from ar at token 2" in differ
    sampled = identical_check([run("ar", [0.1], [1, 2], 1.0), run("sd", [0.1], [1, 3], 1.0)])
    assert "no identity check" in sampled


def test_clamp_step():
    assert clamp_step(3, [1, 2, 3, 4]) == (3, "")
    assert clamp_step(9, [1, 2, 3, 4])[0] == 4 and "no step 9" in clamp_step(9, [1, 2, 3, 4])[1]
    assert clamp_step(0, [1, 2])[0] == 1 and clamp_step("x", [1, 2])[0] == 2
    assert clamp_step(1, []) == (None, "")

"""Replay data: what the app draws for a stored run, computed from its events alone (no model needed).

Steps are the decoder's rounds (StepStarted events); step 0 is the prefill and its first token.
Times are seconds on each run's own clock (RunStarted is t=0), so runs align from their starts.
"""

from __future__ import annotations

from bisect import bisect_right

from engine.events import PREFILL, Event, RunStarted, StepStarted, TimingSpan, TokensEmitted
from engine.measure.metrics import metrics_of


def replay_steps(events: list[Event]) -> list[int]:
    """The decoder's steps in a stream: what a step slider (live or replay) and the branch tree can show."""
    return sorted({e.step for e in events if isinstance(e, StepStarted)})


def events_up_to_step(events: list[Event], step: int) -> list[Event]:
    """The prefix of the stream through the end of `step`: everything before the next step starts,
    plus any late event that still belongs to a step <= `step`. Past the last step: all events."""
    cut = next((i for i, e in enumerate(events) if isinstance(e, StepStarted) and e.step > step), len(events))
    late = [i for i, e in enumerate(events[cut:], cut) if getattr(e, "step", None) is not None and e.step <= step]
    return list(events[: max([cut] + [i + 1 for i in late])])


def run_label(events: list[Event]) -> str:
    """A run's name on figures and traces: its method."""
    start = next((e for e in events if isinstance(e, RunStarted)), None)
    return start.method if start else "run"


def stored_run_label(run: dict) -> str:
    """A stored run (a Store run row) as a picker entry: method, status and id."""
    return f"{run['method']} · {run['status']} · {run['id']}"


def tokens_by_step(events: list[Event]) -> dict[int, int]:
    """Tokens committed in each step."""
    out: dict[int, int] = {}
    for e in events:
        if isinstance(e, TokensEmitted):
            out[e.step] = out.get(e.step, 0) + len(e.tokens)
    return out


def timed_emissions(events: list[Event]) -> list[tuple[float, TokensEmitted]]:
    """Each emission with its time. An emission carries no clock of its own, so it is placed at the latest
    measured moment before it (a forward's end or a step's start)."""
    now, out = 0.0, []
    for e in events:
        if isinstance(e, TimingSpan):
            now = max(now, e.end)
        elif isinstance(e, StepStarted):
            now = max(now, e.t)
        elif isinstance(e, TokensEmitted) and e.tokens:
            out.append((round(now, 6), e))
    return out


def emission_times(events: list[Event]) -> list[tuple[float, int]]:
    """(t, tokens committed so far) after each emission (timed as in timed_emissions)."""
    total, out = 0, []
    for t, e in timed_emissions(events):
        total += len(e.tokens)
        out.append((t, total))
    return out


def decode_start(events: list[Event]) -> float:
    """When decoding began on the run's clock: the end of the prefill (else the first step's start)."""
    prefill = [e.end for e in events if isinstance(e, TimingSpan) and e.kind == PREFILL]
    if prefill:
        return max(prefill)
    return next((e.t for e in events if isinstance(e, StepStarted)), 0.0)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def metric_diffs(base: dict, other: dict) -> dict:
    """other - base for every numeric metric (None where either run lacks the number)."""
    return {
        k: (round(other[k] - v, 6) if _is_number(v) and _is_number(other.get(k)) else None)
        for k, v in base.items()
        if _is_number(v) or v is None
    }


def unique_labels(labels: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label}#{seen[label]}")
    return out


def align_by_step(runs: list[list[Event]]) -> list[dict]:
    """Per step: tokens committed in it by each run, and each run's running total."""
    per_run = [tokens_by_step(events) for events in runs]
    steps = sorted({s for counts in per_run for s in counts})
    totals = [0] * len(runs)
    rows = []
    for step in steps:
        tokens = [counts.get(step, 0) for counts in per_run]
        totals = [a + b for a, b in zip(totals, tokens)]
        rows.append({"step": step, "tokens": tokens, "total": list(totals)})
    return rows


def align_by_time(runs: list[list[Event]]) -> list[dict]:
    """At every moment some run committed tokens: each run's total committed by then."""
    curves = [emission_times(events) for events in runs]
    times = sorted({t for curve in curves for t, _ in curve})
    rows = []
    for t in times:
        totals = []
        for curve in curves:
            i = bisect_right([ct for ct, _ in curve], t)
            totals.append(curve[i - 1][1] if i else 0)
        rows.append({"t": t, "total": totals})
    return rows


def compare_runs(runs: list[list[Event]]) -> dict:
    """Side-by-side data for runs of one prompt (e.g. ar, sd, pearl, specbranch); the first is the baseline.
    Returns labels, metrics per run, diffs (run - first, numeric metrics), speedup (tokens/s ÷ first's),
    by_step and by_time alignments."""
    metrics = [metrics_of(events) for events in runs]
    base = metrics[0] if metrics else {}
    speed = base.get("tokens_per_s")
    base_speed = speed if _is_number(speed) else None  # a run stored before imports were checked may hold anything
    return {
        "labels": unique_labels([run_label(events) for events in runs]),
        "metrics": metrics,
        "diffs": [metric_diffs(base, m) for m in metrics],
        "speedup": [
            round(m["tokens_per_s"] / base_speed, 6) if base_speed and _is_number(m.get("tokens_per_s")) else None
            for m in metrics
        ],
        "by_step": align_by_step(runs),
        "by_time": align_by_time(runs),
    }

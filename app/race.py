"""The race: runs of one prompt replayed side by side from their recorded events, on one clock.

The runs themselves were made one after another (clean timings); here each column reveals its tokens at
the times its TokensEmitted events happened, relative to its own decode start, so the faster method visibly
finishes first. Very short runs are slowed down by one common factor (relative speeds unchanged, and the
tokens/s shown are always the measured ones) so that a person can watch them.
"""

from __future__ import annotations

import html
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import gradio as gr

from engine.events import Event, RunStarted, TokensEmitted
from engine.measure.metrics import metrics_of
from sessions.replay import decode_start, run_label, timed_emissions, unique_labels

from .figures import timeline_figure

FPS = 10  # updates a second
MIN_SECONDS = 4.0  # a race shorter than this is slowed down to last this long
MAX_SECONDS = 60.0  # and one longer (a long run, or an imported one whose clock says hours) sped up to end in this
ORDINAL = {1: "1st", 2: "2nd", 3: "3rd"}


@dataclass
class Lane:
    label: str
    emissions: list[tuple[float, TokensEmitted]]  # seconds since this run's decode start
    duration: float  # when its last token came
    tokens_per_s: float | None  # measured, from the run's metrics

    def shown(self, t: float) -> list[TokensEmitted]:
        return [e for at, e in self.emissions if at <= t]


def lane_of(events: list[Event], label: str) -> Lane:
    start = decode_start(events)
    emissions = [(max(0.0, t - start), e) for t, e in timed_emissions(events)]
    speed = metrics_of(events).get("tokens_per_s")
    return Lane(
        label,
        emissions,
        max((t for t, _ in emissions), default=0.0),
        float(speed) if isinstance(speed, (int, float)) and not isinstance(speed, bool) else None,
    )


def lanes_of(runs: list[list[Event]]) -> list[Lane]:
    labels = unique_labels([run_label(events) for events in runs])
    return [lane_of(events, label) for events, label in zip(runs, labels)]


def live_speed(lane: Lane, t: float) -> str:
    """Tokens/s so far on the measured clock (after the prefill's first token); the measured figure at the end."""
    if t >= lane.duration:
        return "–" if lane.tokens_per_s is None else f"{lane.tokens_per_s:.1f}"
    decoded = sum(len(e.tokens) for at, e in lane.emissions[1:] if at <= t)
    return f"{decoded / t:.1f}" if t > 0 and decoded else "–"


def lane_html(lane: Lane, t: float, place: int | None) -> str:
    shown = lane.shown(t)
    total = sum(len(e.tokens) for _, e in lane.emissions)
    count = sum(len(e.tokens) for e in shown)
    done = t >= lane.duration
    tokens = "".join(
        f'<span class="tok tok-{html.escape(kind)}">{html.escape(piece)}</span>'
        for e in shown
        for piece, kind in zip(e.pieces, e.kinds)
    )
    rank = ORDINAL.get(place, f"{place}th")
    finish = f'<span class="race-place">{rank} · done in {1000 * lane.duration:.0f} ms</span>' if done else ""
    progress = 100 * count / total if total else 100
    return (
        f'<div class="race-col" data-label="{html.escape(lane.label)}" data-done="{str(done).lower()}">'
        f'<div class="race-head"><b>{html.escape(lane.label)}</b> <span class="race-speed">'
        f'{live_speed(lane, t)} tokens/s</span> <span class="race-count">{count}/{total} tokens</span> {finish}'
        f'</div><div class="race-bar"><div style="width:{progress:.1f}%"></div></div>'
        f'<div class="race-text token-view">{tokens}</div></div>'
    )


def race_html(lanes: list[Lane], t: float, stretch: float) -> str:
    """Every column at race time t (measured seconds since the decode starts)."""
    order = sorted(range(len(lanes)), key=lambda i: lanes[i].duration)
    places = {i: rank + 1 for rank, i in enumerate(order)}
    longest = max((lane.duration for lane in lanes), default=0.0)
    done = t >= longest
    slowed = (
        f" · shown {stretch:.0f}× slower so it can be watched; tokens/s are as measured"
        if stretch > 1.5
        else f" · shown {1 / stretch:.0f}× faster; tokens/s are as measured"
        if stretch < 1 / 1.5
        else ""
    )
    columns = "".join(lane_html(lane, t, places[i]) for i, lane in enumerate(lanes))
    return (
        f'<div class="race-wrap" data-done="{str(done).lower()}"><div class="race-clock">race clock '
        f"{1000 * min(t, longest):.0f} / {1000 * longest:.0f} ms since each decode started{slowed}</div>"
        f'<div class="race" style="grid-template-columns:repeat({len(lanes)}, minmax(0, 1fr))">{columns}</div>'
        "</div>"
    )


def race_frames(
    runs: list[list[Event]], clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep
) -> Iterator[str]:
    """The race as HTML frames, about FPS a second, ending with every column complete."""
    lanes = lanes_of(runs)
    longest = max((lane.duration for lane in lanes), default=0.0)
    stretch = min(max(1.0, MIN_SECONDS / longest), MAX_SECONDS / longest) if longest > 0 else 1.0
    begin = clock()
    while (t := (clock() - begin) / stretch) < longest:
        yield race_html(lanes, t, stretch)
        sleep(1 / FPS)
    yield race_html(lanes, longest, stretch)


def is_greedy(events: list[Event]) -> bool:
    start = next((e for e in events if isinstance(e, RunStarted)), None)
    temperature = (start.config or {}).get("temperature") if start else None
    return isinstance(temperature, (int, float)) and temperature == 0


def identical_check(runs: list[list[Event]]) -> str:
    """At temperature 0 every method must give the target's greedy text: say whether the runs agree."""
    labels = unique_labels([run_label(events) for events in runs])
    ids = [[t for e in events if isinstance(e, TokensEmitted) for t in e.tokens] for events in runs]
    if not all(is_greedy(events) for events in runs):
        return (
            '<div class="identical identical-na">sampled (temperature &gt; 0): outputs differ by design, '
            "so there is no identity check; compare the statistics</div>"
        )
    for label, mine in zip(labels[1:], ids[1:]):
        if mine != ids[0]:
            at = next((i for i, (a, b) in enumerate(zip(ids[0], mine)) if a != b), min(len(ids[0]), len(mine)))
            return (
                f'<div class="identical identical-no">✗ outputs differ at temperature 0: '
                f"{html.escape(label)} departs from {html.escape(labels[0])} at token {at + 1}</div>"
            )
    return (
        f'<div class="identical identical-yes">✓ identical output at temperature 0: all {len(runs)} runs '
        f"emitted the same {len(ids[0])} tokens</div>"
    )


def race_updates(runs: list[list[Event]], table: Callable[[list[list[Event]]], str]) -> Iterator[tuple]:
    """(race, summary, timelines) updates: the race as it runs, then the speedup table, the identity check
    and the timelines on one axis."""
    frame = ""
    for frame in race_frames(runs):
        yield frame, gr.skip(), gr.skip()
    yield frame, identical_check(runs) + table(runs), timeline_figure(runs)


NEEDS_TWO = (
    '<div class="notice notice-warning">A race needs two or more runs: pick at least two methods '
    "(or two stored runs), and they run one after another, then race side by side.</div>"
)

"""Every view of an event stream at one step, as Live and Replay show it: both render through views_at."""

from __future__ import annotations

import html

import gradio as gr

from engine.events import Event, Notice
from engine.measure.metrics import compute_metrics
from sessions.replay import replay_steps

from .figures import acceptance_figure, cumulative_figure, timeline_figure
from .navigator import step_strip, step_times
from .tree import tree_html
from .views import glance_html, metric_panel, token_view

VIEWS = 9  # how many views views_at gives


def notice_html(events: list[Event], error: str | None = None, warning: str | None = None) -> str:
    notes = [
        f'<div class="notice notice-{html.escape(e.level)}">{html.escape(e.message)}</div>'
        for e in events
        if isinstance(e, Notice)
    ]  # a replayed Notice may come from an imported file
    if warning:
        notes.append(f'<div class="notice notice-warning">{html.escape(warning)}</div>')
    if error:
        notes.append(f'<div class="notice notice-error">{html.escape(error)}</div>')
    return "".join(notes)


def highlight_of(events: list[Event], step: int | None):
    """(step, start, end) for the timeline's shading of the selected step, where the step has a time."""
    span = step_times(events).get(step) if step is not None else None
    return None if span is None else (step, *span)


def views_at(
    events: list[Event],
    step: int | None = None,
    warning: str | None = None,
    show_rollbacks: bool = False,
    ar_speed: float | None = None,
    whole: list[Event] | None = None,
):
    """Every view of a (possibly partial) event stream: live and replay render through this. In order:
    token view, metric panel, notices, at-a-glance line, branch tree, timeline, step strip, acceptance,
    cumulative. step None: the last step. whole: the whole run, when `events` is a prefix of it (Replay
    at a step): its step strip still offers every step."""
    steps = replay_steps(events)
    step = step if step in steps else (steps[-1] if steps else None)
    return (
        token_view(events, show_rollbacks),
        metric_panel(events),
        notice_html(events, warning=warning),
        glance_html(events, ar_speed),
        tree_html(events, step),
        timeline_figure([events], highlight_of(events, step)),
        step_strip(whole or events, step),
        acceptance_figure(compute_metrics(events)),
        cumulative_figure(events),
    )


def skips(n: int) -> tuple:
    """n outputs left as they are."""
    return (gr.skip(),) * n


def error_html(message: str) -> str:
    return f'<div class="notice notice-error">{html.escape(message)}</div>'


def failure_message(exc: Exception) -> str:
    """What to say where a run broke off: the advice for running out of memory, else the error itself."""
    return "out of memory: try fewer tokens or a smaller pair" if "out of memory" in str(exc) else str(exc)

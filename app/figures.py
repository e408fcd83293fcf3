"""Plotly figures built from the event stream alone (live and replay draw the same pictures).
All times on the figures are measured host times from TimingSpan events."""

from __future__ import annotations

import html

import plotly.graph_objects as go

from engine.events import DraftProposed, Event, Rollback, TimingSpan, TokensEmitted
from engine.measure.metrics import busy_intervals
from sessions.replay import run_label

KIND_COLOURS = {
    "prefill": "#9e9e9e",
    "draft": "#4caf50",
    "branch_draft": "#8e24aa",
    "verify": "#1e88e5",
    "decode": "#1e88e5",
    "assisted_generate": "#607d8b",
}
BUBBLE = "rgba(244, 67, 54, 0.25)"


def plot_text(value) -> str:
    """A string from a run (its method, a span's kind: a stored or imported run may hold anything) as Plotly text.
    Plotly reads a subset of HTML in trace names, tick labels and hover text (<a href>, <span style>, <b>, ...) and
    %{...} in a hover template as a field; escaped, the string shows as written: Plotly turns &lt;, &gt;, &amp; and
    numeric entities back into characters (not &quot;, so quotes stay as they are, harmless outside a tag)."""
    return html.escape(str(value), quote=False).replace("%", "&#37;")


def timeline_figure(runs: list[list[Event]], highlight: tuple[int, float, float] | None = None) -> go.Figure:
    """Gantt chart: one lane per (run, model); bars are forward passes, red bubbles are idle gaps.
    highlight: (step, start, end) shades the step the navigator selected."""
    fig = go.Figure()
    lanes = []
    for events in runs:
        name = plot_text(run_label(events))
        spans = [e for e in events if isinstance(e, TimingSpan)]
        if not spans:
            continue
        window = (min(s.start for s in spans), max(s.end for s in spans))
        for worker in ("draft", "target"):
            if any(s.worker == worker for s in spans):
                lanes.append(f"{name} · {worker}")
                add_lane(fig, lanes[-1], spans, worker, window)
    if highlight is not None:
        step, start, end = highlight
        fig.add_vrect(
            x0=1000 * start,
            x1=1000 * max(end, start + 1e-4),
            fillcolor="rgba(255, 143, 0, 0.18)",
            line=dict(color="#ff8f00", width=1),
            annotation_text=f"step {int(step)}",
            annotation_position="top left",
        )
    fig.update_layout(
        barmode="overlay",
        height=120 + 45 * len(lanes),
        margin=dict(l=10, r=10, t=40, b=30),
        title="Measured timeline (ms): draft and target forwards, idle gaps in red",
        xaxis_title="time since the run started (ms, measured)",
        yaxis=dict(autorange="reversed"),
    )
    return fig


def add_lane(fig: go.Figure, lane: str, spans: list[TimingSpan], worker: str, window: tuple[float, float]) -> None:
    """One model's lane of a run: a bar per forward (a trace per kind of forward), then its idle gaps within
    `window` (s), each trace in the legend once."""
    mine = [s for s in spans if s.worker == worker]
    for kind in sorted({s.kind for s in mine}):
        bars, label = [s for s in mine if s.kind == kind], plot_text(kind)
        fig.add_trace(
            go.Bar(
                y=[lane] * len(bars),
                x=[1000 * (s.end - s.start) for s in bars],
                base=[1000 * s.start for s in bars],
                orientation="h",
                name=label,
                legendgroup=label,
                showlegend=label not in {t.name for t in fig.data},
                marker_color=KIND_COLOURS.get(kind, "#333"),
                customdata=[[s.step, s.tokens] for s in bars],
                hovertemplate=f"{label}<br>step %{{customdata[0]}}, %{{customdata[1]}} tokens<br>"
                "%{base:.1f}–%{x:.1f} ms long<extra>" + lane + "</extra>",
            )
        )
    busy = busy_intervals(spans, worker, *window)
    gaps = [(a_end, b_start) for (_, a_end), (b_start, _) in zip(busy, busy[1:]) if b_start - a_end > 1e-4]
    if gaps:
        fig.add_trace(
            go.Bar(
                y=[lane] * len(gaps),
                x=[1000 * (b - a) for a, b in gaps],
                base=[1000 * a for a, _ in gaps],
                orientation="h",
                name="idle (bubble)",
                legendgroup="idle",
                showlegend="idle (bubble)" not in {t.name for t in fig.data},
                marker_color=BUBBLE,
                hovertemplate="idle %{x:.1f} ms<extra>" + lane + "</extra>",
            )
        )


def acceptance_figure(metrics: dict) -> go.Figure:
    per_pos = [x if x is not None else 0 for x in metrics.get("per_position_acceptance") or []]
    hist = metrics.get("accepted_length_histogram") or {}
    fig = go.Figure()
    fig.add_trace(go.Bar(x=list(range(1, len(per_pos) + 1)), y=per_pos, name="P(accept at i | before accepted)"))
    fig.add_trace(
        go.Bar(x=[int(k) for k in hist], y=list(hist.values()), name="accepted length (count)", yaxis="y2", opacity=0.5)
    )
    fig.update_layout(
        title="Per-position acceptance and accepted-length histogram",
        height=300,
        barmode="group",
        margin=dict(l=10, r=10, t=40, b=30),
        xaxis_title="draft position / accepted length",
        yaxis=dict(title="acceptance", range=[0, 1]),
        yaxis2=dict(title="count", overlaying="y", side="right"),
    )
    return fig


def cumulative_figure(events: list[Event]) -> go.Figure:
    """Cumulative drafted, accepted and rolled-back tokens over (measured) time."""
    t, drafted, accepted, rolled = [], [], [], []
    d = a = r = 0
    now = 0.0
    for e in events:
        if isinstance(e, TimingSpan):
            now = max(now, e.end)
            continue
        if isinstance(e, DraftProposed):
            d += len(e.tokens)
        elif isinstance(e, TokensEmitted):
            a += sum(k in ("accepted", "rescued") for k in e.kinds)
        elif isinstance(e, Rollback) and e.model == "draft":
            r += len(e.tokens)
        else:
            continue
        t.append(1000 * now), drafted.append(d), accepted.append(a), rolled.append(r)
    fig = go.Figure()
    for name, ys in (("drafted", drafted), ("accepted", accepted), ("rolled back", rolled)):
        fig.add_trace(go.Scatter(x=t, y=ys, mode="lines", name=name, line_shape="hv"))
    fig.update_layout(
        title="Cumulative draft tokens",
        height=300,
        margin=dict(l=10, r=10, t=40, b=30),
        xaxis_title="time (ms, measured)",
        yaxis_title="tokens",
    )
    return fig

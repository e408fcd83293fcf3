"""Plotly figures built from the event stream alone (live and replay draw the same pictures).
All times on the figures are measured host times from TimingSpan events."""
from __future__ import annotations

import plotly.graph_objects as go

from engine.events import BranchResolved, DraftProposed, Event, Rollback, TimingSpan, TokensEmitted, Verified
from engine.metrics import busy_intervals
from sessions.replay import replay_steps, run_label

KIND_COLOURS = {"prefill": "#9e9e9e", "draft": "#4caf50", "branch_draft": "#8e24aa", "verify": "#1e88e5",
                "decode": "#1e88e5", "assisted_generate": "#607d8b"}
BUBBLE = "rgba(244, 67, 54, 0.25)"


def timeline_figure(runs: list[list[Event]]) -> go.Figure:
    """Gantt chart: one lane per (run, model); bars are forward passes, red bubbles are idle gaps."""
    fig = go.Figure()
    lanes = []
    for events in runs:
        name = run_label(events)
        spans = [e for e in events if isinstance(e, TimingSpan)]
        if not spans:
            continue
        end = max(s.end for s in spans)
        start = min(s.start for s in spans)
        for worker in ("draft", "target"):
            mine = [s for s in spans if s.worker == worker]
            if not mine:
                continue
            lane = f"{name} · {worker}"
            lanes.append(lane)
            for kind in sorted({s.kind for s in mine}):
                bars = [s for s in mine if s.kind == kind]
                fig.add_trace(go.Bar(
                    y=[lane] * len(bars), x=[1000 * (s.end - s.start) for s in bars],
                    base=[1000 * s.start for s in bars], orientation="h", name=kind, legendgroup=kind,
                    showlegend=kind not in {t.name for t in fig.data}, marker_color=KIND_COLOURS.get(kind, "#333"),
                    customdata=[[s.step, s.tokens] for s in bars],
                    hovertemplate=f"{kind}<br>step %{{customdata[0]}}, %{{customdata[1]}} tokens<br>"
                                  "%{base:.1f}–%{x:.1f} ms long<extra>" + lane + "</extra>"))
            busy = busy_intervals(spans, worker, start, end)
            gaps = [(a_end, b_start) for (_, a_end), (b_start, _) in zip(busy, busy[1:]) if b_start - a_end > 1e-4]
            if gaps:
                fig.add_trace(go.Bar(
                    y=[lane] * len(gaps), x=[1000 * (b - a) for a, b in gaps], base=[1000 * a for a, _ in gaps],
                    orientation="h", name="idle (bubble)", legendgroup="idle",
                    showlegend="idle (bubble)" not in {t.name for t in fig.data}, marker_color=BUBBLE,
                    hovertemplate="idle %{x:.1f} ms<extra>" + lane + "</extra>"))
    fig.update_layout(barmode="overlay", height=120 + 45 * len(lanes), margin=dict(l=10, r=10, t=40, b=30),
                      title="Measured timeline (ms): draft and target forwards, idle gaps in red",
                      xaxis_title="time since the run started (ms, measured)", yaxis=dict(autorange="reversed"))
    return fig


def tree_figure(events: list[Event], step: int | None = None) -> go.Figure:
    """One step, as the target saw it: the verified draft tokens (green accepted, red rejected, grey
    thrown away after the rejection), the branch point with each candidate and its branch (survivor
    green), the target's own token (orange), and, on the lowest row, what the draft drafted meanwhile."""
    steps = replay_steps(events)
    fig = go.Figure()
    if not steps:
        fig.update_layout(title="no steps yet", height=260)
        return fig
    step = steps[-1] if step is None or step not in steps else step
    verdict = next((e for e in events if isinstance(e, Verified) and e.step == step), None)
    fork = next((e for e in events if isinstance(e, BranchResolved) and e.step == step), None)
    emitted = next((e for e in events if isinstance(e, TokensEmitted) and e.step == step), None)
    meanwhile = [e for e in events if isinstance(e, DraftProposed) and e.step == step]
    if fork is not None and any(d.kind == "candidates" and d.tokens == fork.candidates for d in meanwhile):
        meanwhile = [d for d in meanwhile if d.kind == "path"]  # the fork was drafted and resolved in this step
    xs, ys, texts, colours, hovers = [], [], [], [], []

    def node(x, y, text, colour, hover):
        xs.append(x), ys.append(y), texts.append(text), colours.append(colour), hovers.append(hover)

    node(0, 0, "▶", "#616161", "committed prefix")
    path = verdict.pieces if verdict else []
    accepted = verdict.accepted if verdict else 0
    for i, piece in enumerate(path):
        status = "accepted" if i < accepted else ("rejected" if i == accepted else "thrown away")
        colour = {"accepted": "#43a047", "rejected": "#e53935", "thrown away": "#bdbdbd"}[status]
        hover = status  # p, q and u exist up to the first rejection, where verification stopped
        if i < len(verdict.p):
            ratio = verdict.p[i] / verdict.q[i] if verdict.q[i] else 0.0
            u = "" if verdict.u[i] < 0 else f", u={verdict.u[i]:.3f}"
            hover = f"{status}: p={verdict.p[i]:.3f}, q={verdict.q[i]:.3f}, p/q={ratio:.3f}{u}"
        node(i + 1, 0, piece, colour, hover)
    base = len(path)
    if fork is not None:
        k = len(fork.candidates)
        for b, piece in enumerate(fork.pieces):
            y = (k - 1) / 2 - b
            won = b == fork.survivor
            node(base + 1, y, piece, "#43a047" if won else "#e53935",
                 f"candidate {b + 1} ({fork.scheme}): q={fork.q[b]:.3f}, p={fork.p[b]:.3f}"
                 + ((" · survived" + (" (rescued a rejection)" if fork.rescued else "")) if won else " · dropped"))
            for j, piece2 in enumerate(fork.branch_pieces[b]):
                node(base + 2 + j, y, piece2, "#a5d6a7" if won else "#ef9a9a",
                     "branch: next path, verified next step" if won else "rolled back with its branch")
    if verdict is not None and verdict.next_token >= 0 and emitted is not None and emitted.pieces:
        x = accepted + 1
        node(x, -1.5 if fork is None else -(len(fork.candidates) + 1) / 2, emitted.pieces[-1], "#fb8c00",
             f"{verdict.next_kind} from the target (drawn with p={verdict.next_p:.3f})")
    if fork is not None and fork.survivor < 0 and emitted is not None and emitted.pieces:
        node(base + 1, -(len(fork.candidates) + 1) / 2, emitted.pieces[-1], "#fb8c00",
             "no branch matched: the target's own token")
    low = min(ys) - 1.5
    for i, d in enumerate(meanwhile):
        label = "/".join(d.pieces) if d.kind == "candidates" else d.pieces[0] if d.pieces else "?"
        node(i + 1, low, label, "#90caf9", f"drafted meanwhile ({d.kind}{'' if d.kind != 'branch' else f' {d.branch}'})"
             f": q={', '.join(f'{q:.2f}' for q in d.q)}")
    fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers+text", text=texts, textposition="top center",
                             marker=dict(size=16, color=colours, line=dict(width=1, color="#333")),
                             hovertext=hovers, hoverinfo="text"))
    fig.update_layout(title=f"Step {step}: what the target verified (green kept, red rejected/dropped, orange its "
                            f"own token); blue: drafted meanwhile", height=320, showlegend=False,
                      margin=dict(l=10, r=10, t=40, b=20), xaxis=dict(title="position after the prefix", dtick=1),
                      yaxis=dict(visible=False))
    return fig


def acceptance_figure(metrics: dict) -> go.Figure:
    per_pos = [x if x is not None else 0 for x in metrics.get("per_position_acceptance") or []]
    hist = metrics.get("accepted_length_histogram") or {}
    fig = go.Figure()
    fig.add_trace(go.Bar(x=list(range(1, len(per_pos) + 1)), y=per_pos, name="P(accept at i | before accepted)"))
    fig.add_trace(go.Bar(x=[int(k) for k in hist], y=list(hist.values()), name="accepted length (count)", yaxis="y2",
                         opacity=0.5))
    fig.update_layout(title="Per-position acceptance and accepted-length histogram", height=300, barmode="group",
                      margin=dict(l=10, r=10, t=40, b=30), xaxis_title="draft position / accepted length",
                      yaxis=dict(title="acceptance", range=[0, 1]),
                      yaxis2=dict(title="count", overlaying="y", side="right"))
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
    fig.update_layout(title="Cumulative draft tokens", height=300, margin=dict(l=10, r=10, t=40, b=30),
                      xaxis_title="time (ms, measured)", yaxis_title="tokens")
    return fig

"""Pure functions from the event stream to what the page shows. Token text is model output and a replayed
run may come from an imported file, so every string from an event is HTML-escaped here, in one place."""
from __future__ import annotations

import html

from engine.events import Event, Rollback, TokensEmitted, Verified
from engine.metrics import FORMULAS, metrics_of

KIND_LABEL = {"accepted": "accepted draft token", "correction": "target correction", "bonus": "bonus token",
              "target": "target token", "rescued": "rescued by a branch"}


def token_view(events: list[Event]) -> str:
    """Committed tokens coloured by origin; rolled-back tokens struck through after the step that dropped them.
    Hover text gives p, q, the acceptance ratio and the uniform draw when there was a verification."""
    parts = []
    verdicts = {e.step: e for e in events if isinstance(e, Verified)}
    for e in events:
        if isinstance(e, TokensEmitted):
            v = verdicts.get(e.step)
            for i, (piece, kind) in enumerate(zip(e.pieces, e.kinds)):
                title = KIND_LABEL.get(kind, kind)
                if v is not None and kind == "accepted" and i < len(v.p):
                    ratio = v.p[i] / v.q[i] if v.q[i] else float("nan")
                    u = "greedy" if v.u[i] < 0 else f"{v.u[i]:.3f}"
                    title += f" | p={v.p[i]:.3f} q={v.q[i]:.3f} p/q={ratio:.3f} u={u}"
                elif v is not None and kind in ("correction", "bonus"):
                    title += f" | drawn with probability {v.next_p:.3f}"
                parts.append(f'<span class="tok tok-{html.escape(kind)}" title="{html.escape(title)}">'
                             f'{html.escape(piece)}</span>')
        elif isinstance(e, Rollback) and e.tokens:
            dropped = html.escape("".join(e.pieces))
            parts.append(f'<span class="tok tok-rollback" title="rolled back ({html.escape(e.reason)})">{dropped}</span>')
    return f'<div class="token-view">{"".join(parts)}</div>'


def metric_panel(events: list[Event]) -> str:
    m = metrics_of(events)  # a stored run older than a metric still shows it, computed from its events
    rows = []
    for key, formula in FORMULAS.items():
        value = m.get(key)
        if key == "idle_fraction":
            value = f"target {fmt(m.get('target_idle_fraction'))}, draft {fmt(m.get('draft_idle_fraction'))}"
        elif isinstance(value, list):
            value = ", ".join(fmt(x) for x in value)
        else:
            value = fmt(value)
        rows.append(f"<tr><td>{key.replace('_', ' ')}</td><td class='num'>{html.escape(value)}</td>"
                    f"<td class='formula'>{html.escape(formula)}</td></tr>")
    return f'<table class="metric-panel">{"".join(rows)}</table>'


def fmt(x) -> str:
    """A value as plain text (HTML callers escape it): a float is formatted as a number only when it is one,
    anything else (a stored or imported run may hold any JSON) is just its string."""
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)

"""Pure functions from the event stream to what the page shows. Token text is model output and a replayed
run may come from an imported file, so every string from an event is HTML-escaped here, in one place."""

from __future__ import annotations

import html
import math

from engine.config import BASELINE
from engine.events import DECODE, VERIFY, Event, Rollback, RunStarted, TimingSpan, TokensEmitted, Verified
from engine.measure.metrics import FORMULAS, metrics_of
from sessions.replay import run_label

WALL_SPLIT = ("overlap", "target_alone_fraction", "draft_alone_fraction", "neither_fraction")  # metric_panel's order
KIND_LABEL = {
    "accepted": "accepted draft token",
    "correction": "target correction",
    "bonus": "bonus token",
    "target": "target token",
    "rescued": "rescued by a branch",
}


def token_title(kind: str, i: int, v: Verified | None) -> str:
    """Hover text of a committed token: its origin, and p, q, p/q and u where it was verified."""
    title = KIND_LABEL.get(kind, kind)
    if v is not None and kind == "accepted" and i < len(v.p):
        ratio = v.p[i] / v.q[i] if v.q[i] else float("nan")
        u = "greedy" if v.u[i] < 0 else f"{v.u[i]:.3f}"
        title += f" | p={v.p[i]:.3f} q={v.q[i]:.3f} p/q={ratio:.3f} u={u}"
    elif v is not None and kind in ("correction", "bonus"):
        title += f" | drawn with probability {v.next_p:.3f}"
    return title


def rollback_marker(step: int, rollbacks: list[Rollback], show: bool) -> str:
    """A step's rolled-back draft text behind a small marker that expands on click (open: show all)."""
    count = sum(len(r.tokens) for r in rollbacks)
    why = ", ".join(dict.fromkeys(r.reason for r in rollbacks))
    dropped = "".join(
        f'<span class="tok tok-rollback" title="rolled back ({html.escape(r.reason)})">'
        f"{html.escape(''.join(r.pieces))}</span>"
        for r in rollbacks
    )
    return (
        f'<details class="rb"{" open" if show else ""}><summary title="step {step}: {count} drafted token(s) '
        f'rolled back ({html.escape(why)}); click to show">↶{count}</summary>{dropped}</details>'
    )


def token_view(events: list[Event], show_rollbacks: bool = False) -> str:
    """Committed tokens coloured by origin; each step's rolled-back draft tokens sit behind a marker after
    its committed tokens (show_rollbacks: all markers open). Hover a token for p, q, p/q and u."""
    verdicts = {e.step: e for e in events if isinstance(e, Verified)}
    steps: dict[int, tuple[list[str], list[Rollback]]] = {}  # in order of first appearance
    for e in events:
        if isinstance(e, TokensEmitted):
            parts = steps.setdefault(e.step, ([], []))[0]
            for i, (piece, kind) in enumerate(zip(e.pieces, e.kinds)):
                title = token_title(kind, i, verdicts.get(e.step))
                parts.append(
                    f'<span class="tok tok-{html.escape(kind)}" title="{html.escape(title)}">'
                    f"{html.escape(piece)}</span>"
                )
        elif isinstance(e, Rollback) and e.tokens and e.model == "draft":  # the target's copy names the same tokens
            steps.setdefault(e.step, ([], []))[1].append(e)
    out = [
        ("".join(parts) + (rollback_marker(step, rbs, show_rollbacks) if rbs else ""))
        for step, (parts, rbs) in steps.items()
    ]
    return f'<div class="token-view">{"".join(out)}</div>'


def one_token_step_s(events: list[Event]) -> tuple[float, str] | None:
    """(seconds, where it was measured) of the target's one-token step in a run: the median of its one-token
    forwards (AR's decode steps, a verify pass of one token, a token a hold leaves to the target), else the step the
    engine measured before the run, which its RunStarted event carries (a speculative run's passes feed several
    tokens each), else None."""
    one = sorted(
        e.end - e.start
        for e in events
        if isinstance(e, TimingSpan)
        and e.worker == "target"
        and e.kind in (DECODE, VERIFY)
        and e.tokens == 1
        and e.end > e.start
    )
    if one:
        mid = len(one) // 2
        return (
            one[mid] if len(one) % 2 else (one[mid - 1] + one[mid]) / 2
        ), f"the median of the target's {len(one)} one-token forwards in this run"
    start = next((e for e in events if isinstance(e, RunStarted)), None)
    ms = getattr(start, "target_step_ms", -1.0)
    if isinstance(ms, (int, float)) and not isinstance(ms, bool) and math.isfinite(ms) and ms > 0:
        return ms / 1000, "the target's one-token step, measured by the engine before this run"
    return None


def glance_html(events: list[Event], ar_tokens_per_s: float | None = None) -> str:
    """At a glance: how much faster the answer came, then tokens per target forward and α. The speedup is against
    an AR run of the same prompt where one was measured; before that (a first chat), against the target's own
    one-token step as measured in this run, labelled as such; neither: no speedup is claimed."""
    m = metrics_of(events)
    speed = m.get("tokens_per_s")
    speed = float(speed) if isinstance(speed, (int, float)) and not isinstance(speed, bool) and speed > 0 else None
    items = []
    if ar_tokens_per_s and speed and run_label(events) != BASELINE:
        items.append(
            (
                "vs AR on this prompt",
                f"{speed / ar_tokens_per_s:.2f}×",
                f"({fmt(speed)} vs {fmt(float(ar_tokens_per_s))} tokens/s)",
                "this run's tokens/s over an AR run of the same prompt, both measured",
            )
        )
    elif speed and (step := one_token_step_s(events)) is not None:
        step_s, where = step
        items.append(
            (
                "speed",
                f"≈ {speed * step_s:.2f}× the target's one-token step",
                f"({fmt(speed)} tokens/s; one step {1000 * step_s:.1f} ms)",
                f"this run's tokens/s times {where}: what plain decoding would make at best. Run ar on this "
                "prompt for a measured comparison",
            )
        )
    items += [
        ("tokens per target forward", fmt(m.get("mean_accepted_length")), "", ""),
        ("α (acceptance rate)", fmt(m.get("acceptance_rate")), "", ""),
    ]
    cells = "".join(glance_item(*item, big=i == 0 and len(items) == 3) for i, item in enumerate(items))
    return f'<div class="glance">{cells}</div>'


def glance_item(label: str, value: str, note: str, why: str, big: bool = False) -> str:
    title = f' title="{html.escape(why)}"' if why else ""
    return (
        f'<span class="glance-item{" glance-speed" if big else ""}"{title}><span class="glance-label">'
        f"{html.escape(label)}</span> <b>{html.escape(value)}</b>{' ' + html.escape(note) if note else ''}</span>"
    )


def metric_panel(events: list[Event]) -> str:
    m = metrics_of(events)  # a stored run older than a metric still shows it, computed from its events
    rows = []
    for key, formula in FORMULAS.items():
        value = m.get(key)
        if key == "idle_fraction":
            value = f"target {fmt(m.get('target_idle_fraction'))}, draft {fmt(m.get('draft_idle_fraction'))}"
        elif key == "wall_split":
            value = " / ".join(fmt(m.get(f)) for f in WALL_SPLIT)
        elif isinstance(value, list):
            value = ", ".join(fmt(x) for x in value)
        else:
            value = fmt(value)
        rows.append(
            f"<tr><td>{key.replace('_', ' ')}</td><td class='num'>{html.escape(value)}</td>"
            f"<td class='formula'>{html.escape(formula)}</td></tr>"
        )
    return f'<table class="metric-panel">{"".join(rows)}</table>'


def fmt(x) -> str:
    """A value as plain text (HTML callers escape it): a float is formatted as a number only when it is one,
    anything else (a stored or imported run may hold any JSON) is just its string."""
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)

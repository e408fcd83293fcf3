"""The regime map in the "How to read this" tab: for every draft of one bench run (docs/results/json/regime-map.json,
engine/measure/regime.py), each method's measured speedup against `ar` at the draft's α, over the forwards-only
model's curve of that method. Where a draft's curves for PEARL and SpecBranch part is where branches can pay."""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

import plotly.graph_objects as go

from .figures import plot_text

MAP = Path(__file__).resolve().parent.parent / "docs" / "results" / "json" / "regime-map.json"  # a fixed path
METHODS = {
    "sd": ("SD", "#9e9e9e", "dot"),
    "pearl": ("PEARL", "#1e88e5", "dash"),
    "specbranch": ("SpecBranch", "#8e24aa", "solid"),
}
SYMBOLS = ["circle", "square", "diamond", "triangle-up", "x", "star", "hexagon", "cross"]


def number(value) -> float | None:
    """A finite number read from the file, else None (the file is data: anything may be in it)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def load_map(path: Path = MAP) -> tuple[dict | None, str]:
    """(the map, "") or (None, why not): a missing or unreadable file is said, not raised."""
    try:
        data = json.loads(path.read_text())
        drafts, alphas = data["drafts"], [number(a) for a in data["alphas"]]
        if not isinstance(drafts, dict) or None in alphas:
            raise ValueError("drafts or alphas malformed")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"no regime map to draw ({path.name}: {e})"
    return {"drafts": drafts, "alphas": alphas, "when": str(data.get("bench_when") or "")}, ""


def regime_figure(data: dict) -> go.Figure:
    """Speedup against `ar` over α: per draft (a marker of its own) and method (a colour), the measured point at the
    draft's α and the model's curve."""
    fig = go.Figure()
    for i, (draft, entry) in enumerate(data["drafts"].items()):
        if not isinstance(entry, dict) or not isinstance(entry.get("methods"), dict):
            continue
        alpha, c, name = number(entry.get("alpha")), number(entry.get("c")), plot_text(draft)
        for method, (label, colour, dash) in METHODS.items():
            m = entry["methods"].get(method)
            if not isinstance(m, dict):
                continue
            line = m.get("curve")
            if isinstance(line, list) and len(line) == len(data["alphas"]):
                ys = [number(y) for y in line]
                fig.add_scatter(
                    x=data["alphas"],
                    y=ys,
                    mode="lines",
                    line=dict(color=colour, dash=dash, width=1),
                    opacity=0.45,
                    name=f"{name} · {label} model",
                    legendgroup=name,
                    showlegend=False,
                    hovertemplate=f"{name} · {label} model<br>α %{{x:.2f}}: %{{y:.2f}}× ar<extra></extra>",
                )
            measured = number(m.get("measured"))
            if alpha is not None and measured is not None:
                cost = f"c {c:.1f}, " if c is not None else ""
                fig.add_scatter(
                    x=[alpha],
                    y=[measured],
                    mode="markers",
                    marker=dict(color=colour, size=12, symbol=SYMBOLS[i % len(SYMBOLS)], line=dict(width=1)),
                    name=f"{name} · {label}",
                    legendgroup=name,
                    hovertemplate=f"{name} ({cost}α %{{x:.2f}}) · {label}: %{{y:.2f}}× ar<extra></extra>",
                )
    fig.add_hline(y=1.0, line=dict(color="#424242", width=1), annotation_text="ar", annotation_position="top right")
    fig.update_layout(
        title="Where speculation pays: speedup against ar by the draft's acceptance α (one bench run)",
        xaxis=dict(title="α: the draft's acceptance (its SD run, T=0)", range=[0, 1]),
        yaxis=dict(title="× ar (tokens/s)", rangemode="tozero"),
        height=440,
        margin=dict(l=60, r=20, t=50, b=50),
        legend=dict(font=dict(size=11)),
    )
    return fig


def regime_table(data: dict) -> str:
    """One row per draft of the map: its c and α, and each method's measured speed against `ar` (escaped: the file
    is data)."""
    rows = ["| draft | c | α | sd | pearl | specbranch |", "|---|---|---|---|---|---|"]
    for draft, entry in data["drafts"].items():
        methods = entry.get("methods") if isinstance(entry, dict) else None
        if not isinstance(methods, dict):
            continue
        speeds = [cell(m.get("measured") if isinstance(m := methods.get(method), dict) else None) for method in METHODS]
        rows.append(
            f"| `{html.escape(str(draft))}` | {cell(entry.get('c'))} | {cell(entry.get('alpha'))} | "
            + " | ".join(speeds)
            + " |"
        )
    return "\n".join(rows)


def cell(value) -> str:
    """A number from the file to two decimals, or a dash where it holds none."""
    v = number(value)
    return "–" if v is None else f"{v:.2f}"

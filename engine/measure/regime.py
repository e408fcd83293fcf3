"""The regime map of one bench run: for every draft, its cost ratio c and acceptance α, each method's measured speedup
against `ar`, and the forwards-only model's curve of that method over α.

  c      ar's one-token target step over the draft's step in its SD run (both models alone: SD takes turns)
  α      the draft's acceptance in its SD run (accepted / verified drafted tokens)
  curve  costs.modelled's limit, τ · T_ar / round_ms(T_verify, d · D), with the round's forwards as that method
         measured them and τ(α) = 1 + α + … + α^γ: the tokens a pass yields where each drafted token is accepted with
         probability α, independently, at the method's γ. Where a point sits under its curve, host time and idle
         gaps took the rest (costs.modelled's share of limit); where it sits above, the run's acceptance was not
         independent from token to token (long accepted runs), or its draft length was not a fixed γ.

The bench run names each method's draft with METHOD@DRAFT (report["drafts"]), so every ratio is against the same
`ar` run. `python docs/results/tools/regime_map.py` writes the map; the app's "How to read this" tab draws it.
"""

from __future__ import annotations

from engine.config import BASELINE
from engine.measure.costs import draft_ms_a_round, modelled
from engine.measure.metrics import is_serial, round_ms

ALPHAS = [round(0.02 * i, 2) for i in range(1, 50)]  # 0.02 … 0.98: where the curves are drawn


def tokens_a_pass(alpha: float, gamma: int) -> float:
    """τ of a block of γ drafted tokens, each accepted with probability α given the ones before it were: the accepted
    prefix, plus the target's own token (a correction or the bonus)."""
    return sum(alpha**i for i in range(gamma + 1))


def curve(agg: dict, t_ar: float, method: str, gamma: int) -> list[float] | None:
    """The forwards-only speedup over ALPHAS, the round's forwards as `agg` (one method's pooled bench figures)
    measured them; None where they were not measured (hf-assisted)."""
    t_v = agg.get("target_forward_ms")
    if not t_v or not agg.get("target_forwards"):
        return None
    length = round_ms(t_v, draft_ms_a_round(agg), is_serial(method))
    return [round(tokens_a_pass(a, gamma) * t_ar / length, 3) for a in ALPHAS]


def regime_map(report: dict, dataset: str = "all") -> dict:
    """{"drafts": {draft: {"c", "alpha", "methods": {method: {"measured", "modelled", "tau", "gamma", "curve"}}}},
    "alphas", "bench_command", "bench_when"} from a bench report with an `ar` run and, for each draft, an `sd` run (its
    c and α)."""
    res, drafts = report["results"], report.get("drafts") or {}
    ar = res.get(BASELINE, {}).get(dataset)
    if not ar or not ar.get("target_forward_ms"):
        raise ValueError("the bench report has no ar run to measure against")
    t_ar, model = ar["target_forward_ms"], modelled(report, dataset)
    out: dict = {}
    for label, per in res.items():
        agg, method = per.get(dataset), label.split("@")[0]
        if label == BASELINE or not agg or method == "hf-assisted":
            continue
        draft = drafts.get(label) or label.partition("@")[2]
        gamma = report["settings_by_method"][label]["gamma"]
        entry = out.setdefault(draft, {"c": None, "alpha": None, "methods": {}})
        if method == "sd":
            entry["alpha"] = agg.get("acceptance_rate")
            d = agg.get("draft_forward_ms")
            entry["c"] = round(t_ar / d, 2) if d else None
        entry["methods"][method] = {
            "measured": agg.get("speedup_vs_ar"),
            "modelled": model.get(label, {}).get("modelled"),
            "tau": agg.get("mean_accepted_length"),
            "gamma": gamma,
            "curve": curve(agg, t_ar, method, gamma),
        }
    missing = sorted(d for d, e in out.items() if e["alpha"] is None)
    if missing:
        raise ValueError(f"no sd run for {', '.join(missing)}: its c and α come from one (sd@DRAFT)")
    return {"drafts": out, "alphas": ALPHAS, "bench_command": report.get("command"), "bench_when": report.get("when")}

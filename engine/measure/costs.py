"""`python -m engine costs`: what one forward costs, and how close each benchmarked method is to its limit.

Two parts, both written to one JSON:
  forwards   median ms of the target fed 1..8 tokens, and of the draft fed 1 token on 1..k rows (a branch
             step), each on a cache already holding `--context` tokens, one model at a time, `--threads`
             torch threads (the engine's workers use 1 each); and the target's 1-token step while the draft
             steps on 1..k rows beside it (Engine.branch_costs: what a fork's rows cost the target). Every forward
             runs on its model's own engine worker and is timed by that worker's span (runtime.Worker.timed): on a
             CPU host clocks around the call; on CUDA events on the worker's own stream, so the time the kernels
             took, each model on its stream as in a run, not the time Python took to launch them
  model      for each method of a bench JSON (`python -m engine bench --json`), the speedup it would reach if
             nothing but the forwards cost time, next to the measured one:
               ar           1
               sd           τ · T_ar / (T_verify + d · D)      serial: d draft steps per round, each D ms
               overlapped   τ · T_ar / max(T_verify, d · D)     a round lasts as long as the slower of the two
                                                                 models: the target's pass, or the draft's d steps
             τ = tokens per target forward, T_verify = the run's mean target forward, T_ar = ar's, d = draft steps
             per target pass and D = the mean draft step (both models' forwards as measured beside each other in
             the overlapped runs), all from the same bench run. measured / modelled is the share of the limit
             reached; the rest is idle time the model does not predict and host overhead.
             pace: which model sets an overlapped round's length (draft: d · D > T_verify; serial for SD).
             no waste: the same limit with only the draft steps whose tokens were committed, d · (1 − wasted draft
             rate). Where a method is draft-bound, no waste / modelled is the most that any branch policy can
             add to it at the same forward costs and with as many tokens made by the target (corrections,
             bonuses): each committed token the draft made costs one draft step at the least, so the best a
             policy can do is to waste none (docs/metrics.md). For PEARL it is SpecBranch's headroom over
             PEARL on that pair.
"""

from __future__ import annotations

import asyncio
import json
import statistics
from dataclasses import dataclass

import torch

from engine.config import BASELINE, write_json
from engine.measure.metrics import is_serial, round_ms, round_pace
from engine.models import cache as kv
from engine.runtime import run_apart

COSTS = "costs"  # the kind of a timed forward's span


def step_of(lm, context: int, w: int, per_row: bool, features: dict | None):
    """A forward to time: `w` new tokens, or (per_row) 1 token on each of `w` cache rows (a branch step), on a
    cache holding `context` tokens; each call rolls the cache back to the context."""
    vocab = min(lm.vocab_size, 1000)  # ordinary tokens, whatever the model
    cache = lm.new_cache()
    if features is not None:  # a head drafts on the target's features of the context
        cache.set_target_features(0, features["feats"][:context])
    device = getattr(lm, "device", torch.device("cpu"))
    lm.forward(torch.randint(0, vocab, (1, context)).to(device), cache)
    if per_row:
        cache.batch_repeat_interleave(w)
    x = torch.randint(0, vocab, (w, 1) if per_row else (1, w)).to(device)

    def step():
        lm.forward(x, cache)
        kv.rollback(cache, context)

    return step


async def forward_costs(
    worker, lm, context: int, widths: list[int], per_row: bool = False, reps: int = 15, features: dict | None = None
) -> dict[int, float]:
    """ms of one forward of `w` new tokens, or (per_row) of 1 token on each of `w` cache rows (a branch step), on
    `worker` (the model's engine worker), by its spans: the median of `reps`, the widths taken in turn within each
    rep, so that a drift of the machine's speed (a third within seconds on the 2-core CPU, docs/results/README.md)
    moves them all, not the one measured then."""
    steps = {w: step_of(lm, context, w, per_row, features) for w in widths}
    for step in steps.values():
        await worker.timed(step, kind=COSTS)  # warm
    times = {w: [] for w in widths}
    for _ in range(reps):
        for w, step in steps.items():
            span = await worker.timed(step, kind=COSTS)
            times[w].append(span.end - span.start)
    return {w: round(1000 * statistics.median(t), 3) for w, t in times.items()}


async def busy_draft(worker, lm, context: int, rows: int, stop: asyncio.Event, features: dict | None = None) -> int:
    """Keep the draft stepping on `rows` cache rows, on its worker, until `stop` is set: the load a fork puts beside
    the target (time the target on its own worker meanwhile). Each step is waited for before the next (Worker.timed),
    so that on CUDA the draft's queue stays one step deep. Returns the steps taken."""
    step, n = step_of(lm, context, rows, True, features), 0
    while not stop.is_set():
        await worker.timed(step, kind=COSTS)
        n += 1
    return n


async def target_beside_draft(
    target_worker, target, draft_worker, draft, context: int, rows: int, features: dict | None, reps: int = 5
) -> float:
    """ms of one target step on its worker while the draft steps on `rows` cache rows beside it, on its own."""
    stop = asyncio.Event()
    busy = asyncio.ensure_future(busy_draft(draft_worker, draft, context, rows, stop, features))
    try:
        return (await forward_costs(target_worker, target, context, [1], False, reps))[1]
    finally:
        stop.set()
        await busy


def draft_features(pair, context: int) -> dict | None:
    """The target's features of a random context, for a draft head to draft on (None for other drafts)."""
    if not getattr(pair.draft, "reads_target_features", False):
        return None
    ids = torch.randint(0, min(pair.target.vocab_size, 1000), (1, context)).to(pair.target.device)
    with torch.inference_mode():
        return {"feats": pair.target.forward(ids, pair.target.new_cache(), features=True).features[0]}


def measure(engine, context: int = 200, max_tokens: int = 8, max_rows: int = 4, reps: int = 15) -> dict:
    """The target's and the draft's forward costs, each on its engine worker (forward_costs)."""
    pair = engine.pair
    target = run_apart(
        lambda: forward_costs(engine.target_worker, pair.target, context, list(range(1, max_tokens + 1)), reps=reps)
    )
    result = {"context": context, "target_ms_by_tokens": target}
    if pair.draft is not None:
        feats = draft_features(pair, context)
        result["draft_ms_by_rows"] = run_apart(
            lambda: forward_costs(
                engine.draft_worker, pair.draft, context, list(range(1, max_rows + 1)), True, reps, feats
            )
        )
        result["c"] = round(target[1] / result["draft_ms_by_rows"][1], 2)
    return result


def draft_ms_a_round(agg: dict) -> float:
    """d · D of one method's pooled bench figures: its draft steps per target pass times the mean draft step."""
    rounds = max(agg["target_forwards"] - agg["prompts"], 1)  # the prefill is no round
    return agg["draft_forwards"] / rounds * (agg.get("draft_forward_ms") or 0.0)


def modelled(report: dict, dataset: str = "all") -> dict[str, dict]:
    """Measured and modelled speedup per method of a bench report (see the module's docstring)."""
    res = report["results"]
    ar = res.get(BASELINE, {}).get(dataset)
    if not ar or not ar.get("target_forward_ms"):
        return {}
    t_ar = ar["target_forward_ms"]
    out = {}
    for label, per in res.items():
        agg = per.get(dataset)
        if not agg:
            continue
        method = label.split("@")[0]
        tau, t_v = agg.get("mean_accepted_length"), agg.get("target_forward_ms")
        model = no_waste = pace = None
        if label == BASELINE:
            model = no_waste = 1.0
        elif tau and t_v:  # hf-assisted's forwards are not visible to us
            drafting, serial = draft_ms_a_round(agg), is_serial(method)
            model = tau * t_ar / round_ms(t_v, drafting, serial)
            pace, headroom = round_pace(t_v, drafting, agg.get("wasted_draft_rate"), serial)
            no_waste = model * (headroom or 1.0)
        measured = agg.get("speedup_vs_ar")
        out[label] = {
            "measured": measured,
            "modelled": None if model is None else round(model, 3),
            "share_of_limit": round(measured / model, 3) if model and measured else None,
            "pace": pace,
            "no_waste": None if no_waste is None else round(no_waste, 3),
            "tau": tau,
            "alpha": agg.get("acceptance_rate"),
            "verify_ms": t_v,
            "per_position_acceptance": agg.get("per_position_acceptance"),
        }
    return out


def format_model(rows: dict[str, dict]) -> str:
    lines = [
        "method | measured | modelled (forwards only) | share of limit | pace | no waste | τ | α | target ms/forward",
        "---|---|---|---|---|---|---|---|---",
    ]
    for label, r in rows.items():
        cells = [label] + [
            "" if r[k] is None else r[k] if isinstance(r[k], str) else f"{r[k]:.3g}"
            for k in ("measured", "modelled", "share_of_limit", "pace", "no_waste", "tau", "alpha", "verify_ms")
        ]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def model_bench(path: str, report: dict) -> dict:
    """The modelled limits of every method of a bench report (read from `path`), per dataset; the pooled table is
    printed."""
    out = {"bench": path, "model": {d: modelled(report, d) for d in report["results"].get(BASELINE, {})}}
    print(format_model(out["model"].get("all", {})))
    return out


@dataclass(frozen=True)
class CostsSpec:
    """What `python -m engine costs` measures and models (the flags of the same names)."""

    context: int = 200  # tokens already in the cache
    max_tokens: int = 8  # the target fed 1..max_tokens tokens
    max_rows: int = 4  # the draft's step on 1..max_rows rows
    reps: int = 15  # timed repeats of each forward (the median is kept)
    threads: int = 1  # torch threads for the measuring
    bench: str | None = None  # a bench JSON to model, if any
    json_out: str | None = None  # where to write the results, if anywhere


def measured_forwards(engine, spec: CostsSpec) -> dict:
    """The forward costs of the engine's pair (measure), and what a fork's k rows do to the target step beside them."""
    torch.set_num_threads(max(1, spec.threads))
    out = {
        "forwards": measure(engine, spec.context, spec.max_tokens, spec.max_rows, spec.reps),
        "pair": {"target": engine.pair.target.name, "draft": engine.pair.draft.name if engine.pair.draft else None},
        "threads": spec.threads,
    }
    if engine.pair.draft is not None:
        out["forwards"]["target_ms_beside_draft_rows"] = engine.branch_costs(spec.max_rows).target_busy_ms
    print(json.dumps(out["forwards"]))
    return out


def run_costs(engine, spec: CostsSpec, report: dict | None = None) -> dict:
    """Measure the forwards (unless engine is None: --model-only), then model `report`, the bench JSON at
    spec.bench."""
    out = measured_forwards(engine, spec) if engine is not None else {}
    if report is not None:
        out.update(model_bench(spec.bench, report))
    write_json(spec.json_out, out)
    return out

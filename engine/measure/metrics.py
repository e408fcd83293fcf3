"""Metrics, computed from the event stream alone (so replay reproduces them exactly).
Definitions (docs/specbranch.md (Metrics)):
  tokens/s            tokens emitted after prefill / decode wall time (prefill reported separately)
  acceptance rate     accepted draft tokens / draft tokens the target verified
  mean accepted len   emitted tokens / target forward passes (prefill included, so AR = 1)
  wasted draft rate   drafted tokens never committed (losing branches included) / all drafted tokens
  path rollback rate  the paper's accounting: drafted tokens on the path the target followed and never
                      committed / drafted tokens on that path (losing branches are a hedge: not counted)
  per-position acc.   P(accept at draft position i | positions < i accepted)
  idle fraction       per model: 1 - busy time / decode wall time
  overlap             time both models compute at once / decode wall time
  wall split          decode wall time, split four ways: both compute (overlap), the target alone, the draft
                      alone (the target waits on the draft: SD's drafting, a parallel method's head start) and
                      neither (host); the four add up to 1
  host overhead       decode time with no forward running on either worker, per step
  pace                which model sets a round's length (round_pace): draft, target, or serial (SD)
  no-waste headroom   a round's length / its length with only the draft steps whose tokens were committed
"""

from __future__ import annotations

from engine.config import REGISTRY
from engine.events import (
    ACCEPTED,
    RESCUED,
    BranchResolved,
    DraftProposed,
    Event,
    Finished,
    Rollback,
    RunStarted,
    TimingSpan,
    TokensEmitted,
    Verified,
)

FORMULAS = {
    "tokens_per_s": "tokens emitted after prefill / decode wall time",
    "acceptance_rate": "accepted draft tokens / verified draft tokens",
    "mean_accepted_length": "emitted tokens / target forward passes",
    "wasted_draft_rate": "drafted tokens never committed (rejected, drafted after a rejection, superseded, "
    "on losing branches, or pending at the end) / all drafted tokens",
    "path_rollback_rate": "drafted tokens on the path the target followed, never committed / drafted tokens on "
    "that path. The path: linear drafted tokens, and at each branch point the surviving "
    "candidate and its branch (the draft's first choice and its branch when none survived "
    "or the branch point was never verified); other branches are a hedge, not counted",
    "per_position_acceptance": "P(accept at i | all before i accepted)",
    "idle_fraction": "1 - busy time / decode wall time (per model)",
    "overlap": "time both models compute at once / decode wall time",
    "wall_split": "decode wall time: both compute / the target alone / the draft alone (the target waits on it) / "
    "neither (host); adds up to 1",
    "pace": "which model sets a round (one target forward and the draft steps of it): draft if draft forwards a "
    "round × mean draft forward > mean target forward, else target; serial for SD (one, then the other)",
    "no_waste_headroom": "a round's modelled length / its length with draft forwards a round × (1 - wasted draft "
    "rate). Where the draft sets the pace, the most that any branch or rollback policy could "
    "speed this run up at the same forward costs: each committed draft token costs a draft step",
}


def is_serial(method: str) -> bool:
    """Whether a method's draft and target take turns (SD), so that a round lasts both models' forwards. A name not
    in the registry (a stored run, a bench report's label) is read as overlapped."""
    kind = REGISTRY.get(method)
    return kind is not None and not kind.overlapped


def round_ms(verify_ms: float, draft_ms_a_round: float, serial: bool) -> float:
    """How long a round of one target forward and draft forwards worth `draft_ms_a_round` (d · D) lasts if only the
    forwards cost time: the slower model's share when they overlap, both in turn when serial (SD)."""
    return verify_ms + draft_ms_a_round if serial else max(verify_ms, draft_ms_a_round)


def round_pace(
    verify_ms: float | None, draft_ms_a_round: float, wasted: float | None, serial: bool
) -> tuple[str | None, float | None]:
    """(pace, no-waste headroom) of a run whose rounds are one target forward of `verify_ms` and draft forwards
    worth `draft_ms_a_round`. With only the draft steps whose tokens were committed, d · (1 - wasted), a round would
    last less (round_ms); the ratio is 1 where the target sets the pace. (None, None) where nothing was measured."""
    if not verify_ms or not draft_ms_a_round:
        return None, None
    pace = "serial" if serial else "draft" if draft_ms_a_round > verify_ms else "target"
    return pace, (
        round_ms(verify_ms, draft_ms_a_round, serial)
        / round_ms(verify_ms, draft_ms_a_round * (1 - (wasted or 0.0)), serial)
    )


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _length(intervals) -> float:
    return sum(e - s for s, e in intervals)


def _intersection(a, b) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def busy_intervals(spans: list[TimingSpan], worker: str, start: float, end: float):
    return _union(
        [
            (max(s.start, start), min(s.end, end))
            for s in spans
            if s.worker == worker and s.end > start and s.start < end
        ]
    )


def compute_metrics(events: list[Event]) -> dict:
    """Every metric of a run (the module's docstring defines them), from its events alone."""
    finished = next((e for e in events if isinstance(e, Finished)), None)
    spans = [e for e in events if isinstance(e, TimingSpan)]
    emitted = [e for e in events if isinstance(e, TokensEmitted)]
    verified = [e for e in events if isinstance(e, Verified)]
    new_tokens = sum(len(e.tokens) for e in emitted)
    after_prefill = sum(len(e.tokens) for e in emitted if e.step > 0)
    prefill_end = max((s.end for s in spans if s.kind == "prefill"), default=0.0)
    end = max((s.end for s in spans), default=prefill_end)
    decode_s = finished.decode_s if finished else max(end - prefill_end, 0.0)
    forks = [e for e in events if isinstance(e, BranchResolved)]
    # verification of a block stops at its first rejection: the tokens after it are never verified.
    # A branch point counts as one verified draft position, accepted when some branch survived.
    n_verified = sum(v.accepted + (v.accepted < v.drafted) for v in verified) + len(forks)
    n_accepted = sum(v.accepted for v in verified) + sum(f.survivor >= 0 for f in forks)
    target_forwards = sum(1 for s in spans if s.worker == "target")
    opaque = any(s.kind == "assisted_generate" for s in spans)  # hf-assisted: its forwards are not visible
    draft_forwards = sum(1 for s in spans if s.worker == "draft" and s.kind != "prefill")
    passed, reached = per_position(verified)
    waste = draft_waste(events)
    steps = sum(1 for e in events if e.type == "step_started")
    return {
        "new_tokens": new_tokens,
        "tokens_per_s": round(after_prefill / decode_s, 3) if decode_s > 0 else 0.0,
        "prefill_s": round(finished.prefill_s if finished else prefill_end, 6),
        "decode_s": round(decode_s, 6),
        "acceptance_rate": round(n_accepted / n_verified, 6) if n_verified else None,
        "mean_accepted_length": round(new_tokens / target_forwards, 6) if target_forwards and not opaque else None,
        **waste,
        "verified_tokens": n_verified,
        "accepted_tokens": n_accepted,
        "target_forwards": target_forwards,
        "draft_forwards": draft_forwards,
        "per_position_acceptance": [round(p / r, 6) if r else None for p, r in zip(passed, reached)],
        "per_position_counts": [[p, r] for p, r in zip(passed, reached)],  # (accepted, reached): pools across runs
        "accepted_length_histogram": _histogram([v.accepted for v in verified]),
        **wall_split(spans, prefill_end, decode_s, steps, draft_forwards > 0),
        "branch_points": len(forks),
        "branch_rescues": sum(f.rescued for f in forks),
        "rescue_rate": round(sum(f.rescued for f in forks) / len(forks), 6) if forks else None,
        **branch_counts(forks),
        **forward_pace(events, spans, draft_forwards, waste["wasted_draft_rate"], opaque),
    }


def per_position(verified: list[Verified]) -> tuple[list[int], list[int]]:
    """(accepted, reached) at each draft position: a verdict on the surviving branch (branch >= 1, judged in the pass
    that resolved its branch point) goes on from the step's path verdict, since its tokens sit after the path and the
    branch point (which passed)."""
    offsets, base = [], {}
    for v in verified:
        if v.branch == 0:
            base[v.step] = v.drafted
        offsets.append(0 if v.branch == 0 else base.get(v.step, 0) + 1)
    longest = max((o + v.drafted for o, v in zip(offsets, verified)), default=0)
    reached, passed = [0] * longest, [0] * longest
    for o, v in zip(offsets, verified):
        if o:
            reached[o - 1] += 1
            passed[o - 1] += 1
        for i in range(v.drafted):
            if i <= v.accepted:
                reached[o + i] += 1
                passed[o + i] += i < v.accepted
    return passed, reached


def wall_split(spans: list[TimingSpan], start: float, decode_s: float, steps: int, has_draft: bool) -> dict:
    """The decode window [start, start + decode_s] split four ways: both models compute (overlap), the target alone,
    the draft alone (the target waits on it) and neither (host work: Python, sampling, verification)."""
    busy = {w: busy_intervals(spans, w, start, start + decode_s) for w in ("target", "draft")}
    wall = max(decode_s, 1e-9)
    both = _intersection(busy["target"], busy["draft"])
    neither = decode_s - _length(_union(busy["target"] + busy["draft"]))
    return {
        "target_idle_fraction": round(1 - _length(busy["target"]) / wall, 6),
        "draft_idle_fraction": round(1 - _length(busy["draft"]) / wall, 6) if has_draft else None,
        "overlap": round(both / wall, 6),
        "target_alone_fraction": round((_length(busy["target"]) - both) / wall, 6),
        "draft_alone_fraction": round((_length(busy["draft"]) - both) / wall, 6),
        "neither_fraction": round(max(0.0, neither) / wall, 6),
        "host_overhead_ms_per_step": round(1000 * neither / steps, 3) if steps else None,
    }


def forward_pace(
    events: list[Event], spans: list[TimingSpan], draft_forwards: int, wasted: float | None, opaque: bool
) -> dict:
    """The mean forward of each model, which one sets a round's pace and the no-waste headroom (round_pace)."""

    def mean_ms(worker, kinds):
        d = [s.end - s.start for s in spans if s.worker == worker and s.kind in kinds]
        return round(1000 * sum(d) / len(d), 3) if d else None

    started = next((e for e in events if isinstance(e, RunStarted)), None)
    verify_ms, draft_ms = mean_ms("target", ("decode", "verify")), mean_ms("draft", ("draft", "branch_draft"))
    target_forwards = sum(1 for s in spans if s.worker == "target")
    rounds = target_forwards - any(s.kind == "prefill" and s.worker == "target" for s in spans)
    pace, headroom = (
        (None, None)
        if opaque or not rounds or draft_ms is None
        else round_pace(
            verify_ms, draft_forwards / rounds * draft_ms, wasted, started is not None and is_serial(started.method)
        )
    )
    return {
        "target_forward_ms": verify_ms,
        "draft_forward_ms": draft_ms,
        "pace": pace,
        "no_waste_headroom": None if headroom is None else round(headroom, 4),
    }


def branch_counts(forks: list[BranchResolved]) -> dict:
    """[rescues, branch points] by k (how many candidates) and by depth (path tokens before the branch point
    when it was forked; 0 = at the first draft token after the committed ones): where forking pays."""
    by_k: dict[str, list[int]] = {}
    depth = max((f.depth for f in forks), default=-1) + 1
    by_depth = [[0, 0] for _ in range(depth)]
    for f in forks:
        counts = by_k.setdefault(str(len(f.candidates)), [0, 0])
        counts[0], counts[1] = counts[0] + f.rescued, counts[1] + 1
        if f.depth >= 0:
            by_depth[f.depth][0] += f.rescued
            by_depth[f.depth][1] += 1
    return {"rescues_by_k": dict(sorted(by_k.items(), key=lambda kv: int(kv[0]))), "rescues_by_depth": by_depth}


def draft_waste(events: list[Event]) -> dict:
    """The two rollback figures (docs/specbranch.md (Metrics)), from the events alone:

    wasted draft rate  = (drafted - committed) / drafted
    path rollback rate = (path drafted - committed) / path drafted
      drafted       every token of every DraftProposed: linear tokens, a branch point's candidates, branch tokens
      committed     emitted tokens of kind accepted or rescued: the drafted tokens that entered the output
      path drafted  drafted minus the hedge: the tokens drafted on the path the target followed (`hedge_tokens`)
    A drafted token that is not committed was rejected, drafted after a rejection, superseded by a bonus token,
    cut at EOS, still pending when the run ended, or (wasted rate only) on a losing branch. Every committed
    token lies on the path, so path rollback <= wasted, equal when there are no branch points.
    Events of a run still going (no Finished event) leave out the tokens still pending (drafted, neither
    committed nor in a draft Rollback) from every count until their fate is known."""
    drafted = sum(len(e.tokens) for e in events if isinstance(e, DraftProposed))
    committed = sum(k in (ACCEPTED, RESCUED) for e in events if isinstance(e, TokensEmitted) for k in e.kinds)
    discarded = sum(len(e.tokens) for e in events if isinstance(e, Rollback) and e.model == "draft")
    hedge, pending_hedge = hedge_tokens(events)
    if any(isinstance(e, Finished) for e in events):
        pending = pending_hedge = 0
    else:
        pending = max(drafted - committed - discarded, 0)
    settled = drafted - pending
    on_path = settled - (hedge - pending_hedge)
    return {
        "wasted_draft_rate": round((settled - committed) / settled, 6) if settled else None,
        "path_rollback_rate": round((on_path - committed) / on_path, 6) if on_path else None,
        "drafted_tokens": drafted,
        "wasted_draft_tokens": settled - committed,
        "path_drafted_tokens": on_path,
        "path_rolled_back_tokens": on_path - committed,
    }


def hedge_tokens(events: list[Event]) -> tuple[int, int]:
    """Drafted tokens off the path the target followed: at each branch point, every candidate and its branch
    except the path's one. The path's candidate is the survivor (BranchResolved.survivor); when no candidate
    survived, or the branch point was dropped unverified (a rejection before it, or the run ended), it is the
    draft's first choice (candidate 0), where a draft without branches would have drafted on.
    A branch point opens with DraftProposed(kind="candidates"); its branch steps (kind="branch", branch=i+1)
    and its end (BranchResolved, or a draft Rollback that drops it) come before the next one opens (the engine
    keeps at most one pending). Returns (hedge tokens, those of a branch point still pending at the end)."""
    hedge, sizes, path, pending = 0, [], 0, False
    for e in [*events, None]:  # None closes the last branch point
        if e is None or (isinstance(e, DraftProposed) and e.kind == "candidates"):
            off = sum(sizes) - (sizes[path] if sizes else 0)
            hedge += off
            if e is None:
                return hedge, off if pending else 0
            sizes, path, pending = [1] * len(e.tokens), 0, True
        elif isinstance(e, DraftProposed) and e.kind == "branch" and 0 < e.branch <= len(sizes):
            sizes[e.branch - 1] += len(e.tokens)
        elif isinstance(e, BranchResolved):
            path = e.survivor if 0 <= e.survivor < len(sizes) else 0
            pending = False
        elif isinstance(e, Rollback) and e.model == "draft":
            pending = False


def metrics_of(events: list[Event]) -> dict:
    """What live showed (the Finished event's metrics; recomputed for a partial run), plus, computed from the
    events, any metric the stored run did not record because it predates that metric."""
    done = next((e for e in events if isinstance(e, Finished) and e.metrics), None)
    computed = compute_metrics(events)
    return computed if done is None else {**computed, **done.metrics}


def _histogram(values: list[int]) -> dict[str, int]:
    hist: dict[str, int] = {}
    for v in sorted(values):
        hist[str(v)] = hist.get(str(v), 0) + 1
    return hist

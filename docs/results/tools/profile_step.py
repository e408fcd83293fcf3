"""Where a step's host time goes: each method's runs under cProfile, on the event loop's thread only (the thread that
runs the engine's Python between and beside the forwards; the workers' threads run the forwards themselves).

    python docs/results/tools/profile_step.py --draft embedded --json docs/results/json/profile-embedded.json

For each method: the bench's host overhead (ms a step with neither model computing), and the functions that take the
most of the loop thread's time a step (own time, and time with what they call), from the tuning prompts
(data/tuning_prompts.jsonl: never the benchmark split). cProfile slows the Python it profiles, not the forwards, so the
host figures are the runs' own, measured in separate runs without the profiler.

`gaps`: what the loop thread was in while neither model computed, from runs without cProfile. Each gap between the
forwards' spans is named by the forwards around it (e.g. `target:verify -> draft:draft`), and its time is split among
the engine functions below (GAP_FUNCTIONS), each counted while it is the innermost one running; `forward` is the wait
for a worker's answer beyond the span it reports (the hand-over to the worker's thread, the draft process's message
and its reading), `(none)` the loop between them.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import dataclasses
import functools
import inspect
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from engine.config import GenerationConfig, ModelSettings  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.events import TimingSpan  # noqa: E402
from engine.load import load_engine  # noqa: E402
from engine.methods import decoding, drafting, parallel, verdict  # noqa: E402
from engine.presets import config_for, draft_forward  # noqa: E402


def prompts(engine: Engine, limit: int) -> list[list[int]]:
    rows = [json.loads(line) for line in (ROOT / "data" / "tuning_prompts.jsonl").read_text().splitlines() if line]
    return [engine.encode(r["prompt"], r.get("chat", True)) for r in rows[:limit]]


def profile(engine: Engine, cfg: GenerationConfig, encoded: list[list[int]], top: int) -> dict:
    """Host ms a step without the profiler, then the loop thread's profile a step with it."""
    host, steps = [], 0
    for ids in encoded:
        host.append(engine.run(ids, cfg).metrics["host_overhead_ms_per_step"])
    prof = cProfile.Profile()
    for ids in encoded:
        prof.enable()
        r = engine.run(ids, cfg)
        prof.disable()
        steps += sum(1 for e in r.events if e.type == "step_started")
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, name), (_, calls, own, cum, _) in stats.stats.items():
        where = f"{Path(file).relative_to(ROOT) if file.startswith(str(ROOT)) else Path(file).name}:{line} {name}"
        rows.append({"function": where, "calls_a_step": round(calls / steps, 2), "own_ms_a_step": own * 1e3 / steps,
                     "cum_ms_a_step": cum * 1e3 / steps})  # fmt: skip
    mine = [r for r in rows if r["function"].startswith("engine/")]
    by = lambda key: sorted(mine, key=lambda r: -r[key])[:top]  # noqa: E731
    return {
        "host_ms_a_step": round(statistics.median(host), 3),
        "steps_profiled": steps,
        "top_own": [
            {**r, **{k: round(r[k], 3) for k in ("own_ms_a_step", "cum_ms_a_step")}} for r in by("own_ms_a_step")
        ],
        "top_cum": [
            {**r, **{k: round(r[k], 3) for k in ("own_ms_a_step", "cum_ms_a_step")}} for r in by("cum_ms_a_step")
        ],
    }


GAP_FUNCTIONS = {
    decoding: ["read_row", "forward"],
    drafting: ["read_rows", "branch_step", "fork_here", "hold_here", "head_start", "draft_until_verdict"],
    parallel: ["verify_round", "keep_verified", "verify_pass"],
    verdict: ["resolve", "judge"],
}


def timed(log: list, name: str, fn, clock: dict):
    """fn, logging (perf_counter, '>name') as it starts and '<name' as it returns (awaited, for a coroutine); the
    run's clock (RunState.t0, which every one of them is given first) into `clock`."""
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def run(*args, **kwargs):
            clock.setdefault("t0", getattr(args[0], "t0", None))
            log.append((time.perf_counter(), ">" + name))
            try:
                return await fn(*args, **kwargs)
            finally:
                log.append((time.perf_counter(), "<" + name))

        return run

    @functools.wraps(fn)
    def call(*args, **kwargs):
        clock.setdefault("t0", getattr(args[0], "t0", None))
        log.append((time.perf_counter(), ">" + name))
        try:
            return fn(*args, **kwargs)
        finally:
            log.append((time.perf_counter(), "<" + name))

    return call


def innermost(log: list, lo: float, hi: float) -> collections.Counter:
    """Seconds of [lo, hi] each logged function was the innermost one running in ('(none)': none was)."""
    out, stack, at = collections.Counter(), [], lo
    for t, mark in log:
        if t > hi:
            break
        if t > at:
            out[stack[-1] if stack else "(none)"] += t - at
            at = t
        if mark[0] == ">":
            stack.append(mark[1:])
        elif stack:
            stack.pop()
    out[stack[-1] if stack else "(none)"] += hi - at
    return out


def gaps(engine: Engine, cfg: GenerationConfig, encoded: list[list[int]], top: int = 6) -> dict:
    """Where neither model computed, by the forwards around each gap, ms a step (see the module's docstring)."""
    log, clock = [], {}
    originals = {(m, n): getattr(m, n) for m, names in GAP_FUNCTIONS.items() for n in names}
    wrapped = {fn: timed(log, n, fn, clock) for (_, n), fn in originals.items()}
    patched = [(m, n, f) for m in GAP_FUNCTIONS for n, f in vars(m).items() if callable(f) and f in wrapped]
    for m, n, f in patched:  # each module's own name for it (drafting imports decoding.forward, ...)
        setattr(m, n, wrapped[f])
    by, steps = collections.defaultdict(collections.Counter), 0
    try:
        for ids in encoded:
            log.clear()
            clock.clear()
            result = engine.run(ids, cfg)
            timeline = [(t - clock["t0"], mark) for t, mark in log]  # on the run's clock, as its spans are
            spans = sorted((e for e in result.events if isinstance(e, TimingSpan) and e.kind != "prefill"),
                           key=lambda s: s.start)  # fmt: skip
            steps += sum(1 for e in result.events if e.type == "step_started")
            end, last = None, None
            for s in spans:
                if end is not None and s.start > end:
                    key = f"{last.worker}:{last.kind} -> {s.worker}:{s.kind}"
                    by[key].update(innermost(timeline, end, s.start))
                if end is None or s.end > end:
                    end, last = s.end, s
    finally:
        for m, n, f in patched:
            setattr(m, n, f)
    ms = lambda v: round(1000 * v / steps, 3)  # noqa: E731
    return {
        key: {"ms_a_step": ms(sum(c.values())), "in": {name: ms(v) for name, v in c.most_common(top)}}
        for key, c in sorted(by.items(), key=lambda kv: -sum(kv[1].values()))
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default="embedded")
    parser.add_argument("--methods", default="pearl,specbranch")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--json")
    args = parser.parse_args()
    engine = load_engine(ModelSettings(draft=args.draft, draft_forward=draft_forward()), need_draft=True)
    encoded = prompts(engine, args.prompts)
    report = {"command": " ".join(sys.argv), "draft": args.draft, "draft_worker": engine.pair.draft_worker}
    report["methods"] = {}
    for method in args.methods.split(","):
        given = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
        cfg = config_for(method, args.draft, given).validate()
        engine.run(encoded[0], dataclasses.replace(cfg, max_new_tokens=16))  # warm-up
        report["methods"][method] = profile(engine, cfg, encoded, args.top)
        m = report["methods"][method]
        m["gaps"] = gaps(engine, cfg, encoded)
        print(f"{method}: host {m['host_ms_a_step']} ms a step; loop thread's top own time a step:")
        for r in m["top_own"][:8]:
            print(f"  {r['own_ms_a_step']:7.3f} ms  {r['calls_a_step']:6.1f} calls  {r['function']}")
        print("  where neither model computed, ms a step:")
        for key, g in m["gaps"].items():
            print(f"  {g['ms_a_step']:7.3f}  {key}: " + ", ".join(f"{n} {v}" for n, v in g["in"].items()))
    engine.close()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

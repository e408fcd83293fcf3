"""Where a step's host time goes: each method's runs under cProfile, on the event loop's thread only (the thread that
runs the engine's Python between and beside the forwards; the workers' threads run the forwards themselves).

    python docs/results/tools/profile_step.py --draft embedded --json docs/results/json/profile-embedded.json

For each method: the bench's host overhead (ms a step with neither model computing), and the functions that take the
most of the loop thread's time a step (own time, and time with what they call), from the tuning prompts
(data/tuning_prompts.jsonl: never the benchmark split). cProfile slows the Python it profiles, not the forwards, so the
host figures are the runs' own, measured in separate runs without the profiler.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import pstats
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from engine.config import GenerationConfig, ModelSettings  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.load import load_engine  # noqa: E402
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
        print(f"{method}: host {m['host_ms_a_step']} ms a step; loop thread's top own time a step:")
        for r in m["top_own"][:8]:
            print(f"  {r['own_ms_a_step']:7.3f} ms  {r['calls_a_step']:6.1f} calls  {r['function']}")
    engine.close()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

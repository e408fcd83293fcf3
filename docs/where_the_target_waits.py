"""Where a parallel method's target waits on its draft (docs/RESULTS.md §0m).

The wall split (engine/metrics.py) says how much of the decode wall the draft computes alone, while the target
waits. This script says why, by timing the parallel loop's own phases around the engine's functions (it wraps
them; nothing they do changes): the head start (parallel.head_start: the draft steps before the target's pass, as
after every rejection) and the draft step still running when the target's verdict lands
(parallel.draft_until_verdict returns only after it). It runs PEARL and SpecBranch on the bench's prompts (2 each
of MT-Bench, GSM8K and HumanEval), after one untimed warm-up run each.

  PYTHONPATH=. python docs/where_the_target_waits.py --draft self-skip:3,4,5,25 --json docs/waits-skip.json
"""
from __future__ import annotations

import argparse
import json
import time

from engine import parallel
from engine.config import GenerationConfig
from engine.datasets import benchmark_prompts
from engine.engine import Engine
from engine.models import load_pair

phases: dict[str, list[float]] = {}
_head_start, _draft_until_verdict = parallel.head_start, parallel.draft_until_verdict


async def timed_head_start(*args, **kwargs):
    t = time.perf_counter()
    await _head_start(*args, **kwargs)
    phases.setdefault("head_start", []).append(time.perf_counter() - t)


async def timed_draft_until_verdict(state, spec, ds, policy, target_job, events):
    landed: list[float] = []
    target_job.add_done_callback(lambda _: landed.append(time.perf_counter()))
    await _draft_until_verdict(state, spec, ds, policy, target_job, events)
    # the draft loop checks the verdict between steps: past it, the target has waited on the step in flight
    phases.setdefault("draft_step_after_verdict", []).append(time.perf_counter() - landed[0] if landed else 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default="self-skip:3,4,5,25")
    ap.add_argument("--limit", type=int, default=2, help="prompts per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--settings", default='{"gamma": 3, "draft_stop": 0.3, "head_start": 0.3, "epsilon": 0.5, '
                                           '"branches": 3, "hold": 0.5}', help="GenerationConfig fields, JSON")
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args()
    parallel.head_start, parallel.draft_until_verdict = timed_head_start, timed_draft_until_verdict
    engine = Engine(load_pair("embedded", args.draft))
    prompts = [p for d in ("mt_bench", "gsm8k", "humaneval") for p in benchmark_prompts(d, args.limit)]
    encoded = [engine.encode(p.text, p.chat) for p in prompts]
    report = {"draft": args.draft, "settings": json.loads(args.settings), "methods": {}}
    for method in ("pearl", "specbranch"):
        cfg = GenerationConfig(method=method, max_new_tokens=args.max_new_tokens, temperature=0.0,
                               **report["settings"])
        engine.run(encoded[0], cfg)  # warm-up (and SpecBranch's tables), untimed
        phases.clear()
        runs = [engine.run(ids, cfg).metrics for ids in encoded]
        wall = sum(m["decode_s"] for m in runs)
        rounds = len(phases.get("head_start", []))
        row = {"decode_s": round(wall, 3), "rounds": rounds,
               "tokens_per_s": round(sum(m["tokens_per_s"] * m["decode_s"] for m in runs) / wall, 3)}
        for name, times in phases.items():
            row[f"{name}_s"] = round(sum(times), 3)
            row[f"{name}_share"] = round(sum(times) / wall, 4)
        for key in ("overlap", "target_alone_fraction", "draft_alone_fraction", "neither_fraction"):
            row[key] = round(sum(m[key] * m["decode_s"] for m in runs) / wall, 4)
        report["methods"][method] = row
        print(method, row, flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()

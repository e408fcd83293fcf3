"""The Live tab's scenarios (engine/presets.py SCENARIOS), measured on the TUNING prompts, never the benchmark split:
`python docs/results/tools/tune_scenarios.py --json docs/results/json/scenarios-tuning.json`. (It chose "fastest",
"weak" and the earlier, layer-skipping "rescue"; the app's "rescue" is now the distilled draft's, from bench runs:
docs/app.md "How the scenarios were chosen".)

Loads the embedded target once, as app.py does (each draft in a process of its own, its one-token step compiled:
the script waits for the compile before timing anything), and runs every prompt of data/tuning_prompts.jsonl at the
app's first-chat settings (chat template, 128 new tokens, T=0, seed 0): each candidate right after an `ar` run of the
same prompt, so that its speed is read against AR measured moments before (the machine is shared: its load moves
AR's speed by a factor of 3 within minutes). Per candidate: tokens/s pooled over the prompts (all new tokens / all
decode time) over its paired AR runs' pooled figure, forks per step (branch points resolved / steps), rescues (forks
won by a candidate other than the draft's first choice), and whether the output is AR's. Each candidate has one
untimed warm-up run first.

The rule that picks "rescue" (RULE, written into the JSON): among the self-skip candidates whose forks per step are at
least 0.5 and that rescued on every prompt, the fastest against AR by the median of its per-prompt ratios. Two
sittings: the first grid (CANDIDATES, `--json
docs/results/json/scenarios-tuning.json`), then `--second` (SECOND, `--json docs/results/json/scenarios-tuning-2.json`):
its winner again beside a more accurate layer-skipping draft. Both were chosen as run by the pooled ratio, then again
by RULE (`--rechoose FILE...`, which keeps the choice as run under "chosen_rescue_as_run")."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)

# the app's defaults for a draft kind (app/settings.py, before the presets): the starting points
BASE = {
    "gamma": 3,
    "epsilon": 0.5,
    "draft_stop": 0.3,
    "feed_stop": 0.0,
    "head_start": 0.3,
    "hold": 0.5,
    "hold_branches": True,
    "hrad": False,
}
SELF = {
    "gamma": 8,
    "epsilon": 0.1,
    "draft_stop": 0.0,
    "feed_stop": 0.0,
    "head_start": 0.02,
    "hold": 0.0,
    "hold_branches": False,
    "hrad": False,
}
SKIP = "self-skip:3,4,5,25"
CANDIDATES = [  # (scenario, draft, settings)
    ("fastest", "self", SELF),
    *[
        ("rescue", SKIP, {**BASE, "epsilon": eps, "hold": hold, "hold_branches": hold > 0})
        for eps in (0.5, 0.65)
        for hold in (0.0, 0.5)
    ],
    ("rescue", SKIP, {**BASE, "gamma": 4, "epsilon": 0.65, "hold": 0.0, "hold_branches": False}),
    ("weak", "embedded-weak", BASE),
]
# the second sitting, after the first found every self-skip:3,4,5,25 candidate well below ar (0.29-0.68x) on this
# shared machine: its best again, against the more accurate self-skip:4,5 (the target without 2 layers) forking often
SKIP2 = "self-skip:4,5"
SECOND = [
    ("rescue", SKIP, {**BASE, "epsilon": 0.65, "hold": 0.0, "hold_branches": False}),
    *[("rescue", SKIP2, {**BASE, "epsilon": eps, "hold": 0.0, "hold_branches": False}) for eps in (0.65, 0.8)],
    ("rescue", SKIP2, {**BASE, "epsilon": 0.8, "hold": 0.5, "hold_branches": True}),
]
MIN_FORKS_PER_STEP = 0.5
RULE = (
    f"rescue: among the self-skip candidates with forks per step >= {MIN_FORKS_PER_STEP} that rescued on every "
    "prompt, the fastest against AR by the median of its per-prompt ratios (each prompt against the AR run just "
    "before it). Not the pooled ratio: while other work loads this 2-core machine, a parallel method (its two "
    "models need both cores) slows 3-10x and AR (one core) hardly at all, and pooled by time the few prompts "
    "measured then outweigh the rest"
)


def choose(results: list[dict]) -> dict | None:
    """RULE, applied: the chosen rescue candidate, with its figures."""
    for r in results:
        r["speed_vs_ar_median"] = round(statistics.median(r["speed_vs_ar_per_prompt"]), 3)
    eligible = [
        r
        for r in results
        if r["scenario"] == "rescue"
        and r["forks_per_step"] >= MIN_FORKS_PER_STEP
        and all(n > 0 for n in r["rescues_per_prompt"])
    ]
    chosen = max(eligible, key=lambda r: r["speed_vs_ar_median"]) if eligible else None
    return (
        None
        if chosen is None
        else {
            k: chosen[k]
            for k in (
                "draft",
                "settings",
                "speed_vs_ar_median",
                "speed_vs_ar",
                "forks_per_step",
                "rescues",
                "rescues_per_prompt",
            )
        }
    )


def rechoose(paths: list[str]) -> None:
    """RULE applied again to reports already written (the first two sittings were chosen by the pooled ratio)."""
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        report.setdefault("chosen_rescue_as_run", {"rule": report["rule"], "chosen": report["chosen_rescue"]})
        report["rule"], report["chosen_rescue"] = RULE, choose(report["candidates"])
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
        print(path, report["chosen_rescue"])


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def summary(events) -> dict:
    from engine.events import BranchResolved, Finished, StepStarted, TimingSpan

    done = next(e for e in events if isinstance(e, Finished))
    forks = [e for e in events if isinstance(e, BranchResolved)]
    one = [
        e.end - e.start
        for e in events
        if isinstance(e, TimingSpan) and e.worker == "target" and e.kind in ("decode", "verify") and e.tokens == 1
    ]
    return {
        "new_tokens": done.new_tokens,
        "decode_s": done.decode_s,
        "tokens_per_s": done.metrics.get("tokens_per_s"),
        "steps": sum(isinstance(e, StepStarted) for e in events),
        "forks": len(forks),
        "rescues": sum(f.rescued for f in forks),
        **{
            k: done.metrics.get(k)
            for k in (
                "acceptance_rate",
                "mean_accepted_length",
                "target_forward_ms",
                "draft_forward_ms",
                "pace",
                "overlap",
                "path_rollback_rate",
            )
        },
        "target_one_token_spans": len(one),
        "target_one_token_ms": round(1000 * statistics.median(one), 3) if one else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="data/tuning_prompts.jsonl")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=0, help="first N tuning prompts (0: all)")
    parser.add_argument("--only", default="", help="comma-separated scenarios to run (default: all)")
    parser.add_argument("--second", action="store_true", help="the second sitting's candidates (SECOND)")
    parser.add_argument("--json")
    parser.add_argument("--rechoose", nargs="+", metavar="JSON", help="apply RULE again to these reports; no runs")
    args = parser.parse_args()
    if args.rechoose:
        return rechoose(args.rechoose)
    if not args.json:
        parser.error("--json is required")
    if "tuning" not in os.path.basename(args.prompts):
        raise SystemExit("tune on the tuning prompts only (data/tuning_prompts.jsonl), never the benchmark split")
    os.chdir(ROOT)
    import importlib.util

    import torch

    from engine.config import GenerationConfig
    from engine.measure.datasets import benchmark_prompts

    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("app_script", os.path.join(ROOT, "app.py"))
    appmod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(appmod)
    app_args = SimpleNamespace(
        target="embedded",
        device=None,
        draft_matmul="auto",
        draft_forward="lean-compiled",
        draft_worker="process",
        target_forward="static",
    )
    candidates = [c for c in (SECOND if args.second else CANDIDATES) if not args.only or c[0] in args.only.split(",")]
    drafts = list(dict.fromkeys(d for _, d, _ in candidates))
    cache = appmod.EngineCache(lambda d, t: appmod.load_engine(app_args, d, t), drafts[0], cap=len(drafts))
    engines = {d: cache.get(d) for d in drafts}
    for d, eng in engines.items():  # time compiled steps only, as the app runs once its compile lands
        status = getattr(eng.pair.draft, "compile_status", None)
        while status is not None and status()[0] in ("waiting", "compiling"):
            time.sleep(2)
        print(d, "draft step:", status()[0] if status else "n/a", file=sys.stderr, flush=True)
    prompts = benchmark_prompts(args.prompts, args.limit)
    ar_engine = engines[drafts[0]]
    encoded = [(p, ar_engine.encode(p.text, p.chat)) for p in prompts]

    def cfg(method, settings, n=args.max_new_tokens):
        return GenerationConfig(
            method=method, max_new_tokens=n, temperature=0.0, top_p=1.0, seed=0, branches=3, **settings
        ).validate()

    before = load()
    ar_engine.run(encoded[0][1], cfg("ar", {}, 16))  # warm-ups, untimed
    for _, d, s in candidates:
        engines[d].run(encoded[0][1], cfg("specbranch", s, 16))
    ar_runs, runs = [[] for _ in candidates], [[] for _ in candidates]
    for p, ids in encoded:
        for i, (name, d, s) in enumerate(candidates):
            ar = ar_engine.run(ids, cfg("ar", {}), p.text)
            ar_runs[i].append({"prompt": p.key, **summary(ar.events)})
            r = engines[d].run(ids, cfg("specbranch", s), p.text)
            row = {
                "prompt": p.key,
                **summary(r.events),
                "identical_to_ar": r.token_ids == ar.token_ids,
                "ar_tokens_per_s": ar_runs[i][-1]["tokens_per_s"],
                "load": os.getloadavg()[0],
            }
            row["speed_vs_ar"] = round(row["tokens_per_s"] / row["ar_tokens_per_s"], 3)
            runs[i].append(row)
            print(
                f"prompt {p.key} {name} {d} {s}: {row['tokens_per_s']:.1f} tok/s vs ar {row['ar_tokens_per_s']:.1f} "
                f"({row['speed_vs_ar']}x), forks {row['forks']}/{row['steps']} steps, rescues {row['rescues']}",
                file=sys.stderr,
                flush=True,
            )
    after = load()

    def pooled(rows):
        return sum(r["new_tokens"] for r in rows) / sum(r["decode_s"] for r in rows)

    results = []
    for (name, d, s), rows, ars in zip(candidates, runs, ar_runs):
        results.append(
            {
                "scenario": name,
                "draft": d,
                "method": "specbranch",
                "settings": s,
                "tokens_per_s": round(pooled(rows), 2),
                "ar_tokens_per_s": round(pooled(ars), 2),
                "speed_vs_ar": round(pooled(rows) / pooled(ars), 3),
                "speed_vs_ar_per_prompt": [r["speed_vs_ar"] for r in rows],
                "forks_per_step": round(sum(r["forks"] for r in rows) / sum(r["steps"] for r in rows), 3),
                "rescues": sum(r["rescues"] for r in rows),
                "rescues_per_prompt": [r["rescues"] for r in rows],
                "identical_to_ar": f"{sum(r['identical_to_ar'] for r in rows)}/{len(rows)}",
                "runs": rows,
                "ar_runs": ars,
            }
        )
    report = {
        "command": " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "load_before": before,
            "load_after": after,
            "note": "a 2-core machine shared with other work: speeds are read against an AR run of the same "
            "prompt taken moments before",
        },
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "temperature": 0.0,
        "chat": True,
        "rule": RULE,
        "chosen_rescue": choose(results),
        "candidates": results,
    }
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
    for r in results:
        print(
            f"{r['scenario']:8} {r['draft']:20} eps={r['settings']['epsilon']} hold={r['settings']['hold']} "
            f"gamma={r['settings']['gamma']}: {r['speed_vs_ar']}x ar, forks/step {r['forks_per_step']}, "
            f"rescues {r['rescues']}"
        )
    print("chosen rescue:", report["chosen_rescue"])
    cache.close()


if __name__ == "__main__":
    main()

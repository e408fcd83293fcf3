"""What the target waits on in each round of PEARL and SpecBranch, by how the last verdict ended.

    python docs/results/tools/round_waits.py --draft embedded --dataset all --limit 5 --json OUT.json

A round is one target pass and the draft steps beside and before it. The draft steps that end before the pass
starts are the ones the target waits on (the head start, drafting.head_start): each costs the target a whole draft
step. They are counted by what the previous verdict was:
- `path-rejected`: a drafted path token was rejected (the target's correction ends the verdict);
- `all-accepted`: every fed token held up (a bonus token, or the rest of the path waits for the next pass);
- `empty-pass`: the pass verified no drafted token (PEARL's pre-verify);
- `fork-first` / `fork-rescued` / `fork-none`: the path held up to a branch point, and the draft's first choice,
  another of its candidates, or none of them was the target's token.
The fork outcomes also give the candidates' coverage: how often the k candidates held the target's token.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from engine.config import ModelSettings  # noqa: E402
from engine.events import BranchResolved, Event, TimingSpan, Verified  # noqa: E402
from engine.load import load_engine  # noqa: E402
from engine.measure.datasets import benchmark_prompts  # noqa: E402
from engine.presets import config_for, draft_forward  # noqa: E402


def outcome(events: list[Event]) -> str:
    """How one step's verdict ended (the module's docstring names the outcomes)."""
    fork = next((e for e in events if isinstance(e, BranchResolved)), None)
    if fork is not None:
        return "fork-rescued" if fork.rescued else "fork-first" if fork.survivor == 0 else "fork-none"
    path = next((e for e in events if isinstance(e, Verified) and e.branch == 0), None)
    if path is None or path.drafted == 0:
        return "empty-pass"
    return "path-rejected" if path.accepted < path.drafted else "all-accepted"


def rounds(events: list[Event]) -> list[tuple[str, int, float]]:
    """(the previous verdict's outcome, draft steps the target waited on, their ms) for each round with a pass."""
    by_step = collections.defaultdict(list)
    for e in events:
        if hasattr(e, "step"):
            by_step[e.step].append(e)
    out, last = [], "start"
    for step in sorted(by_step):
        spans = [e for e in by_step[step] if isinstance(e, TimingSpan) and e.kind != "prefill"]
        passes = [s.start for s in spans if s.worker == "target"]
        if not passes:
            continue
        first = min(passes)
        waited = [s for s in spans if s.worker == "draft" and s.end <= first]
        out.append((last, len(waited), 1000 * sum(s.end - s.start for s in waited)))
        last = outcome(by_step[step])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default="embedded")
    parser.add_argument("--methods", default="pearl,specbranch")
    parser.add_argument("--dataset", default="all")
    parser.add_argument("--limit", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--json")
    args = parser.parse_args()
    engine = load_engine(ModelSettings(draft=args.draft, draft_forward=draft_forward()), need_draft=True)
    prompts = benchmark_prompts(args.dataset, args.limit)
    report = {"command": "python " + " ".join(sys.argv), "draft": args.draft, "temperature": args.temperature}
    report.update(prompts=len(prompts), methods={})
    for method in args.methods.split(","):
        given = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
        cfg = config_for(method, args.draft, given).validate()
        seen: list[tuple[str, int, float]] = []
        for p in prompts:
            seen += rounds(engine.run(engine.encode(p.text, p.chat), cfg).events)
        by = collections.defaultdict(list)
        for last, n, ms in seen:
            by[last].append((n, ms))
        report["methods"][method] = {
            "rounds": len(seen),
            "waited_steps_a_round": round(sum(n for _, n, _ in seen) / len(seen), 3),
            "waited_ms_a_round": round(sum(ms for *_, ms in seen) / len(seen), 3),
            "after": {
                last: {
                    "rounds": len(v),
                    "waited_steps_a_round": round(sum(n for n, _ in v) / len(v), 3),
                    "waited_ms_a_round": round(sum(ms for _, ms in v) / len(v), 3),
                }
                for last, v in sorted(by.items(), key=lambda kv: -len(kv[1]))
            },
        }
        m = report["methods"][method]
        print(f"{method}: {m['rounds']} rounds, the target waits {m['waited_steps_a_round']} draft steps "
              f"({m['waited_ms_a_round']} ms) a round")  # fmt: skip
        for last, v in m["after"].items():
            print(f"  after {last:14s} {v['rounds']:5d} rounds  {v['waited_steps_a_round']:.2f} steps  "
                  f"{v['waited_ms_a_round']:.1f} ms")  # fmt: skip
    engine.close()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

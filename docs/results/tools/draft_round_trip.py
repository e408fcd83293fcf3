"""What a draft step through the draft's process costs beyond its forward, in the engine's runs: each answer the
engine reads, timed on both sides of the socket (the child's perf_counter is this process's: RemoteLM.shares_clock).

    python docs/results/tools/draft_round_trip.py --draft embedded --json docs/results/json/round-trip-t0.json

For each method, on the tuning prompts (data/tuning_prompts.jsonl: never the benchmark split), per target step:
- `asked`: answers the child computed once asked (a step it had not taken ahead); `ask_to_start_ms`, from the
  request leaving this process to the child's forward starting (the message, the child's wake-up, its own Python);
- `taken_ahead`: answers the child had computed before it was asked (process.step_ahead);
  `turnaround_ms`, from the end of the child's previous forward to the start of that step: the child's answer to
  the previous request and its pick of the next token, between two forwards it runs back to back;
- `read_ms`: reading an answer here once its fields are on the socket (RemoteLM._answer: they, and the logits off
  the board or the socket);
- `host_ms_a_step`: the bench's host time a step (neither model computing), in the same runs.
Medians and means over every answer; the runs are the engine's own, with nothing else changed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from engine.config import ModelSettings  # noqa: E402
from engine.drafts import process  # noqa: E402
from engine.load import load_engine  # noqa: E402
from engine.presets import config_for, draft_forward  # noqa: E402
from engine.runtime import Measured  # noqa: E402


@dataclass(frozen=True)
class Answer:
    """One answer of the draft's process, on this process's clock (perf_counter seconds)."""

    ahead: bool  # the child had taken the step before it was asked (process.step_ahead)
    asked_at: float  # the request left this process
    read_from: float  # this process began to read the answer
    read_until: float  # ... and had read it
    start: float  # the child's forward began
    end: float  # ... and ended


def timed(log: list[Answer]):
    """RemoteLM's _ask and _answer, logging an Answer per answer."""
    ask, answer = process.RemoteLM._ask, process.RemoteLM._answer

    def timed_ask(self, *args):
        self._asked_at = time.perf_counter()
        return ask(self, *args)

    def timed_answer(self, input_ids, cache, measured):
        before, start = self.steps_taken_ahead, time.perf_counter()
        out = answer(self, input_ids, cache, measured)
        if isinstance(out, Measured):
            ahead = self.steps_taken_ahead > before
            log.append(Answer(ahead, self._asked_at, start, time.perf_counter(), out.start, out.end))
        return out

    return timed_ask, timed_answer


def summary(values: list[float]) -> dict:
    ms = [1000 * v for v in values]
    if not ms:
        return {}
    return {"n": len(ms), "median": round(statistics.median(ms), 3), "mean": round(statistics.mean(ms), 3)}


def measure(engine, cfg, encoded: list[list[int]], log: list[Answer]) -> dict:
    log.clear()
    steps, host = 0, []
    for ids in encoded:
        result = engine.run(ids, cfg)
        steps += sum(1 for e in result.events if e.type == "step_started")
        host.append(result.metrics["host_overhead_ms_per_step"])
    asked = [a for a in log if not a.ahead]
    # a step taken ahead follows the previous answer's forward at once: the child's time between the two
    turn = [b.start - a.end for a, b in zip(log, log[1:]) if b.ahead]
    return {
        "steps": steps,
        "asked_a_step": round(len(asked) / steps, 3),
        "taken_ahead_a_step": round((len(log) - len(asked)) / steps, 3),
        "ask_to_start_ms": summary([a.start - a.asked_at for a in asked]),
        "turnaround_ms": summary(turn),
        "read_ms": summary([a.read_until - a.read_from for a in log]),
        "host_ms_a_step": round(statistics.mean(host), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default="embedded")
    parser.add_argument("--methods", default="pearl,specbranch")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--json")
    args = parser.parse_args()
    engine = load_engine(ModelSettings(draft=args.draft, draft_forward=draft_forward()), need_draft=True)
    if not isinstance(engine.pair.draft, process.RemoteLM):
        raise SystemExit(f"the draft runs in this process ({engine.pair.draft_worker_why}): no socket to time")
    rows = [json.loads(line) for line in (ROOT / "data" / "tuning_prompts.jsonl").read_text().splitlines() if line]
    encoded = [engine.encode(r["prompt"], r.get("chat", True)) for r in rows[: args.prompts]]
    log: list[Answer] = []
    process.RemoteLM._ask, process.RemoteLM._answer = timed(log)
    command = "python " + " ".join(sys.argv)
    report = {"command": command, "draft": args.draft, "temperature": args.temperature, "methods": {}}
    for method in args.methods.split(","):
        cfg = config_for(method, args.draft, {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature})
        cfg = cfg.validate()
        engine.run(encoded[0], dataclasses.replace(cfg, max_new_tokens=16))  # warm-up
        report["methods"][method] = m = measure(engine, cfg, encoded, log)
        print(f"{method}: {m}")
    engine.close()
    if args.json:
        Path(args.json).write_text(json.dumps(report, separators=(",", ":")))


if __name__ == "__main__":
    main()

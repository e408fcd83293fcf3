"""The app's draft compiling in the background (docs/RESULTS.md §0w): the pair loads as the app loads it (the 4-bit
self-draft in its own process, --draft-forward lean-compiled, compile_later), then SpecBranch runs with the app's
settings on the tuning prompts, round after round: before the compile is asked for, while it runs in the draft's
process, and after it has landed; `ar` runs once a round as the baseline. Each run's output is checked against
`ar`'s. inductor's cache is a fresh folder unless --cache names one (a second run with the same folder: warm).
Run: PYTHONPATH=. .venv/bin/python docs/background_compile.py --json docs/background-compile-cold.json"""
import argparse
import json
import os
import sys
import tempfile
import time

parser = argparse.ArgumentParser()
parser.add_argument("--cache", default=None, help="inductor's cache folder (default: a fresh one: a cold compile)")
parser.add_argument("--tokens", type=int, default=64)
parser.add_argument("--after", type=int, default=2, help="rounds after the compile has landed")
parser.add_argument("--json", default=None)
args = parser.parse_args()
os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.cache or tempfile.mkdtemp(prefix="inductor-")  # before torch loads

from app.ui import SELF_DEFAULTS  # noqa: E402
from engine.config import GenerationConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.models import load_pair  # noqa: E402

start = time.perf_counter()
pair = load_pair("embedded", "self", draft_forward="lean-compiled", draft_worker="process", compile_later=True)
loaded_s = time.perf_counter() - start
assert pair.draft_worker == "process", pair.draft_worker_why
engine = Engine(pair)
rows = [json.loads(line) for line in open("data/tuning_prompts.jsonl")]
prompts = [engine.encode(r["prompt"], r.get("chat", True)) for r in rows]
settings = {k: SELF_DEFAULTS[k] for k in ("gamma", "epsilon", "draft_stop", "head_start", "hold")}
sb = GenerationConfig(method="specbranch", max_new_tokens=args.tokens, branches=3, **settings)
ar = GenerationConfig(method="ar", max_new_tokens=args.tokens)


def one_round(phase: str) -> dict:
    """Every tuning prompt once with ar, then once with SpecBranch: tokens/s of each, pooled over the prompts."""
    tokens, seconds, same = {"ar": 0, "specbranch": 0}, {"ar": 0.0, "specbranch": 0.0}, 0
    state = pair.draft.compile_status()[0]
    for ids in prompts:
        want = engine.run(ids, ar)
        got = engine.run(ids, sb)
        same += got.token_ids == want.token_ids
        for name, r in (("ar", want), ("specbranch", got)):
            tokens[name] += r.metrics["new_tokens"]
            seconds[name] += r.metrics["new_tokens"] / r.metrics["tokens_per_s"]
    tps = {k: round(tokens[k] / seconds[k], 2) for k in tokens}
    row = {"phase": phase, "compile_state_at_start": state, "compile_state_at_end": pair.draft.compile_status()[0],
           "since_compile_asked_s": round(time.perf_counter() - asked, 1) if asked else None,
           "tokens_per_s": tps, "specbranch_vs_ar": round(tps["specbranch"] / tps["ar"], 3),
           "outputs_equal_ar": f"{same}/{len(prompts)}"}
    print(json.dumps(row), flush=True)
    return row


asked = None
rounds = [one_round("before")]
asked = time.perf_counter()
pair.draft.start_compile()
while pair.draft.compile_status()[0] == "compiling":
    rounds.append(one_round("while"))
landed_by_s = time.perf_counter() - asked
rounds += [one_round("after") for _ in range(args.after)]
out = {"command": " ".join([sys.executable, *sys.argv]), "inductor_cache": args.cache or "fresh",
       "load_s": round(loaded_s, 1), "compile_landed_within_s": round(landed_by_s, 1),
       "compile_status": pair.draft.compile_status(), "settings": {**settings, "branches": 3, "tokens": args.tokens},
       "rounds": rounds}
print(json.dumps({k: v for k, v in out.items() if k != "rounds"}))
if args.json:
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)
engine.close()

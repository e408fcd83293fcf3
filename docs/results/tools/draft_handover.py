"""What a draft step in its own process costs beyond the child's own forward: the engine's hand-over.

    python docs/results/tools/draft_handover.py --draft embedded --json docs/results/json/draft-handover-embedded.json

Loads the target with a draft (--draft, `embedded` by default) as the engine does (the draft in its own process, its
matmuls as `auto` reads them) and times one-token draft steps through the draft's Worker.run two ways, interleaved
step by step so that the machine's drift falls on both alike: `thread`, a plain call of RemoteLM.forward, which the
worker runs on its own thread (the engine's way before drafts.process.RemoteStep); and `loop`, the RemoteStep the
engine now passes, which the worker awaits on the event loop's thread (RemoteLM.forward_on_loop). For each step: the
time from asking to having the logits, less the child's span (when it computed, on its clock, which this process
shares). First with the machine otherwise idle, then beside a thread that runs target passes of 3 tokens without
pause (as a verify pass runs beside the draft's steps). Medians and means over --steps steps each.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from engine.config import ModelSettings  # noqa: E402
from engine.drafts.process import RemoteLM, step_fn  # noqa: E402
from engine.load import load_engine  # noqa: E402
from engine.presets import draft_forward  # noqa: E402
from engine.runtime import new_event_loop  # noqa: E402

CONTEXT = 20  # the prompt's length: each step is fed at CONTEXT and rolled back to it


async def steps(draft: RemoteLM, worker, n: int) -> dict[str, list[float]]:
    """ms beyond the child's span of n steps each way, alternating."""
    cache = draft.new_cache()
    draft.forward(torch.tensor([[1] * CONTEXT]), cache)
    beyond = {"thread": [], "loop": []}
    for i in range(n * 2):
        how = "loop" if i % 2 else "thread"
        fn = step_fn(draft, 0) if how == "loop" else functools.partial(draft.forward, measured=True)
        asked = time.perf_counter()
        _, span = await worker.run(fn, torch.tensor([[7]]), cache, kind="draft", step=0, t0=0.0)
        beyond[how].append((time.perf_counter() - asked - (span.end - span.start)) * 1e3)
        cache.crop(CONTEXT)
    return beyond


def summary(beyond: dict[str, list[float]]) -> dict:
    return {
        how: {"median_ms": round(statistics.median(v), 3), "mean_ms": round(statistics.mean(v), 3), "steps": len(v)}
        for how, v in beyond.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default="embedded")
    parser.add_argument("--steps", type=int, default=400, help="steps each way, in each condition")
    parser.add_argument("--json")
    args = parser.parse_args()
    engine = load_engine(ModelSettings(draft=args.draft, draft_forward=draft_forward()), need_draft=True)
    draft, target = engine.pair.draft, engine.pair.target
    if not isinstance(draft, RemoteLM):
        sys.exit(f"the draft runs in this process: {engine.pair.draft_worker_why}")
    stop = threading.Event()

    def target_passes():
        torch.set_num_threads(1)
        cache = target.new_cache()
        target.forward(torch.tensor([[1] * 64]), cache)
        while not stop.is_set():
            target.forward(torch.tensor([[5, 6, 7]]), cache)
            cache.crop(64)

    loop = new_event_loop()
    report = {"command": " ".join(sys.argv), "draft": draft.name, "draft_matmul": draft.matmul}
    try:
        report["idle"] = summary(loop.run_until_complete(steps(draft, engine.draft_worker, args.steps)))
        beside = threading.Thread(target=target_passes)
        beside.start()
        try:
            report["beside_target"] = summary(loop.run_until_complete(steps(draft, engine.draft_worker, args.steps)))
        finally:
            stop.set()
            beside.join()
    finally:
        loop.close()
        engine.close()
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

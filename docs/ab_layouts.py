"""Interleaved A/B of the target's forward cost by tokens fed: the linear layers' oneDNN-packed copies on
(engine/lm_head.py, the default) and off (the previous layouts: (W @ xᵀ)ᵀ for 2-3 rows, F.linear from 4).
One token takes the same path either way. docs/RESULTS.md §0d. Run from the repository root, the machine
otherwise idle:
    PYTHONPATH=. .venv/bin/python docs/ab_layouts.py [--reps 10] [--json docs/ab-packed-forward.json]
"""
import argparse
import json
import statistics
import time

import torch

from engine.costs import step_of
from engine.lm_head import HeadMatmul
from engine.models import load_pair

p = argparse.ArgumentParser()
p.add_argument("--reps", type=int, default=10)
p.add_argument("--widths", default="1,2,3,4,5,6,8")
p.add_argument("--json", default=None)
args = p.parse_args()
torch.set_num_threads(1)
target = load_pair("embedded", None, device="cpu").target
matmuls = [m.forward for m in target.model.modules() if isinstance(getattr(m, "forward", None), HeadMatmul)]
matmuls.append(target._head)
saved = [mm.packed for mm in matmuls]


def use_packed(on: bool):
    for mm, packed in zip(matmuls, saved):
        mm.packed = packed if on else None


widths = [int(w) for w in args.widths.split(",")]
steps = {w: step_of(target, 200, w, False, None) for w in widths}
times = {(on, w): [] for on in (True, False) for w in widths}
for on in (True, False):  # warm both
    use_packed(on)
    for step in steps.values():
        step()
for _ in range(args.reps):
    for w in widths:
        for on in (False, True):
            use_packed(on)
            start = time.perf_counter()
            steps[w]()
            times[(on, w)].append(time.perf_counter() - start)
report = {"reps": args.reps, "context": 200, "ms_by_tokens": {
    "previous": {w: round(1000 * statistics.median(times[(False, w)]), 1) for w in widths},
    "packed": {w: round(1000 * statistics.median(times[(True, w)]), 1) for w in widths}}}
for name, row in report["ms_by_tokens"].items():
    print(f"{name:>9}: " + "  ".join(f"{w}: {ms}" for w, ms in row.items()))
if args.json:
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)

"""What a float32 matmul of a few rows costs on this CPU, per kernel: the embedded target's weight shapes, each
weight distinct (60 of them, more than the last-level cache holds), 1 thread, medians of 7 rounds.

    python docs/results/tools/few_rows.py --json docs/results/json/few-rows.json

Kernels: x @ Wᵀ with Wᵀ stored contiguous (MKL), oneDNN's packed weight (lm_head.packed_matmul) and the panel kernel
(engine/kernels/panel.py, where it runs: this CPU's build). Figures are µs a matmul; each row count's ratio to one row
is what a verify pass of that many tokens costs against a one-token step, for that kernel.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine.kernels import cpu, panel  # noqa: E402
from engine.kernels.lm_head import packed_matmul, packed_weight  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
ROWS = (1, 2, 3, 4, 5, 6, 8, 9, 12)


def median_us(fn, weights, rows: int, k: int) -> float:
    x = torch.randn(rows, k)
    for w in weights[:2]:
        fn(x, w)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        for w in weights:
            fn(x, w)
        times.append((time.perf_counter() - start) / len(weights))
    return round(1e6 * statistics.median(times), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    kernels = {"mkl_xwt": (lambda w: w.t().contiguous(), lambda x, w: x @ w)}
    kernels["onednn_packed"] = (packed_weight, packed_matmul)
    if panel.available():
        kernels["panel"] = (panel.pack, panel.matmul)
    out = {"cpu": torch.backends.cpu.get_cpu_capability(), "machine": cpu.name(), "us": {}}
    for name, (n, k) in SHAPES.items():
        base = [torch.randn(n, k) for _ in range(3 if name == "head" else 60)]
        out["us"][name] = {}
        for kernel, (prepare, fn) in kernels.items():
            weights = [prepare(w) for w in base]
            out["us"][name][kernel] = {r: median_us(fn, weights, r, k) for r in ROWS}
            per = out["us"][name][kernel]
            print(name, kernel, " ".join(f"{r}:{per[r]:.0f}({per[r] / per[1]:.2f}x)" for r in ROWS), flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

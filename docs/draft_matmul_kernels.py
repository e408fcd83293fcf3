"""The draft's matmuls by kernel (docs/RESULTS.md §0e, §0f), random weights of their shapes (so they stream from
memory as in a real step), 1 thread, medians of 30 passes:
  draft   the 6-layer draft's 42 linear layers and its 8k-row head
  target  the embedded target's 210 linear layers (its head stays float32 under int4: lm_head.draft_matmul)
Run from the repository root: PYTHONPATH=. .venv/bin/python docs/draft_matmul_kernels.py"""
import torch
import torch.nn.functional as F

from engine.costs import median_ms
from engine.lm_head import Bf16Matmul, Int4Matmul, int4_supported

torch.set_num_threads(1)
H, I, KV = 576, 1536, 192  # SmolLM2-135M: hidden, MLP, k/v width
LAYER = ((H, H), (KV, H), (KV, H), (H, H), (I, H), (I, H), (H, I))
SETS = {"draft": [s for _ in range(6) for s in LAYER] + [(8192, H)], "target": [s for _ in range(30) for s in LAYER]}


def kernels(W, rows):
    x = {k: torch.randn(rows, k) for k in (H, I)}
    xb = {k: v.bfloat16() for k, v in x.items()}
    wt = [w.t().contiguous() for w in W]
    wb = [w.bfloat16() for w in W]
    bf16 = [Bf16Matmul(w) for w in W]
    out = {"float32 x @ Wt": lambda: [x[w.shape[0]] @ w for w in wt],
           "bfloat16 F.linear": lambda: [F.linear(xb[w.shape[1]], b) for w, b in zip(W, wb)],
           "bfloat16 oneDNN-packed (Bf16Matmul, with casts)": lambda: [m(x[w.shape[1]]) for w, m in zip(W, bf16)]}
    if int4_supported():
        int4 = [Int4Matmul(w) for w in W]
        out["int4 groups of 32 (Int4Matmul, with casts)"] = lambda: [m(x[w.shape[1]]) for w, m in zip(W, int4)]
    if rows == 1:
        q = [(w / (w.abs().amax(1, keepdim=True) / 127)).round().to(torch.int8) for w in W]
        scales = [(w.abs().amax(1) / 127).bfloat16() for w in W]
        out["int8 weights, bfloat16 input (_weight_int8pack_mm)"] = lambda: [
            torch.ops.aten._weight_int8pack_mm(xb[w.shape[1]], qw, s) for w, qw, s in zip(W, q, scales)]
    return out


for name, shapes in SETS.items():
    W = [torch.randn(o, i) * 0.02 for o, i in shapes]
    for rows in (1, 3):
        for kernel, fn in kernels(W, rows).items():
            print(f"{name}  {rows} row(s)  {kernel}: {median_ms(fn, 30)} ms")

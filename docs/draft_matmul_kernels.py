"""The draft's matmuls by kernel (docs/RESULTS.md §0e): the 6-layer draft's 42 linear layers and its 8k-row head,
random weights of their shapes (so they stream from memory as in a real step), 1 thread, medians of 30 passes.
Run from the repository root: PYTHONPATH=. .venv/bin/python docs/draft_matmul_kernels.py"""
import torch
import torch.nn.functional as F

from engine.costs import median_ms

torch.set_num_threads(1)
H, I, KV = 576, 1536, 192  # SmolLM2-135M: hidden, MLP, k/v width
SHAPES = [s for _ in range(6) for s in ((H, H), (KV, H), (KV, H), (H, H), (I, H), (I, H), (H, I))] + [(8192, H)]
W = [torch.randn(o, i) * 0.02 for o, i in SHAPES]
WB = [w.bfloat16() for w in W]


def kernels(rows):
    x = {k: torch.randn(rows, k) for k in (H, I)}
    xb = {k: v.bfloat16() for k, v in x.items()}
    wt = [w.t().contiguous() for w in W]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 1) for w in W]
    q = [(w / (w.abs().amax(1, keepdim=True) / 127)).round().to(torch.int8) for w in W]
    scales = [w.abs().amax(1) / 127 for w in W]
    out = {"float32 x @ Wt": lambda: [x[w.shape[0]] @ w for w in wt],
           "bfloat16 F.linear": lambda: [F.linear(xb[w.shape[1]], b) for w, b in zip(W, WB)],
           "bfloat16 oneDNN-packed (Bf16Matmul, with casts)": lambda: [
               torch.ops.mkldnn._linear_pointwise(x[w.shape[1]].bfloat16(), p, None, "none", [], "").float()
               for w, p in zip(W, packed)]}
    if rows == 1:
        out["int8 weights, bfloat16 input (_weight_int8pack_mm)"] = lambda: [
            torch.ops.aten._weight_int8pack_mm(xb[w.shape[1]], qw, s.bfloat16()) for w, qw, s in zip(W, q, scales)]
    return out


for rows in (1, 3):
    for name, fn in kernels(rows).items():
        print(f"{rows} row(s)  {name}: {median_ms(fn, 30)} ms")

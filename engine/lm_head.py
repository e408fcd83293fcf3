"""Matmuls in the layout the CPU's BLAS runs fastest for the number of rows: the LM head, and (fast_linears)
every bias-free linear layer of a float32 model on the CPU.

Measured on the 2-core machine (1 thread, fp32), for SmolLM2's 49,152 x 576 head (docs/RESULTS.md §0):
  rows   F.linear(x, W)   x @ Wᵀ (Wᵀ stored contiguous)   (W @ xᵀ)ᵀ
  1        11.5 ms          5.1 ms                          11.8 ms
  2        24.6 ms         10.7 ms                           5.6 ms
  3        37.2 ms         15.1 ms                           8.1 ms
  4        18.5 ms         21.3 ms                           8.7 ms
  8        20.4 ms         24.1 ms                          14.6 ms
and for all 30 decoder layers' linears in turn, their weights streamed from memory as in a real step
(docs/RESULTS.md §0c; medians of 21 passes):
  rows   F.linear   x @ Wᵀ   (W @ xᵀ)ᵀ
  1       51.9 ms   36.1 ms   44.5 ms
  2       59.9      55.2      25.2
  3       69.3      62.0      38.7
  4       50.0      73.3      39.2
  6       59.2      65.1      60.0
  8       60.5      76.0     112.8
A decode step feeds one row, a verify pass a few: each gets its fast layout. The product is the same up to
float rounding (the summation order differs, as it already does between F.linear's own kernels).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

LAYER_MAX_ROWS = 3  # from 4 rows F.linear was faster in the whole forward (docs/RESULTS.md §0c)
COPY_BUDGET = 2 << 30  # bytes of transposed copies (the one-row layout) a model may add


class HeadMatmul:
    """out = x @ Wᵀ for x [..., H] and W [V, H] (no bias), in the fast layout for the number of rows; more than
    `max_rows` rows (or a gradient to track) go through F.linear. `one_row=False` skips the transposed copy
    that the one-row layout needs (one row then goes through F.linear as well)."""

    def __init__(self, weight: torch.Tensor, max_rows: int | None = None, one_row: bool = True):
        self.w = weight.detach()  # [V, H]
        self.cpu = self.w.device.type == "cpu"
        self.max_rows = max_rows
        self.wt = self.w.t().contiguous() if self.cpu and one_row else None  # [H, V]: the one-row layout (a copy)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        flat = x.reshape(rows, x.shape[-1]).to(self.w.dtype)
        if not self.cpu:
            out = flat @ self.w.t()
        elif (self.max_rows is not None and rows > self.max_rows) or (torch.is_grad_enabled() and x.requires_grad):
            out = F.linear(flat, self.w)
        elif rows == 1:
            out = flat @ self.wt if self.wt is not None else F.linear(flat, self.w)
        else:
            out = (self.w @ flat.t()).t()
        return out.reshape(*x.shape[:-1], -1)


def fast_linears(model: torch.nn.Module) -> int:
    """Route the bias-free linear layers of a float32 model on the CPU through HeadMatmul (a decode step's one
    row and a verify pass's few rows each in their fast layout); the LM head is left to the caller. Adds a
    transposed copy of each weight for the one-row layout while they fit in COPY_BUDGET bytes. Idempotent.
    Returns how many layers were routed."""
    layers = [m for name, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and m.bias is None and "lm_head" not in name
              and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32
              and not getattr(m, "_fast_layout", False)]
    room = COPY_BUDGET
    for m in layers:
        size = m.weight.numel() * m.weight.element_size()
        one_row = size <= room
        room -= size if one_row else 0
        m.forward = HeadMatmul(m.weight, LAYER_MAX_ROWS, one_row)
        m._fast_layout = True
    return len(layers)

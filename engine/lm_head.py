"""The LM head as one matmul, in the layout the CPU's BLAS runs fastest for the number of rows.

Measured on the 2-core machine (1 thread, SmolLM2's 49,152 x 576 head, fp32; docs/RESULTS.md §0):
  rows   F.linear(x, W)   x @ Wᵀ (Wᵀ stored contiguous)   (W @ xᵀ)ᵀ
  1        11.5 ms          5.1 ms                          11.8 ms
  2        24.6 ms         10.7 ms                           5.6 ms
  3        37.2 ms         15.1 ms                           8.1 ms
  4        18.5 ms         21.3 ms                           8.7 ms
  8        20.4 ms         24.1 ms                          14.6 ms
A decode step feeds one row, a verify pass a few: each gets its fast layout. The product is the same up to
float rounding (the summation order differs, as it already does between F.linear's own kernels).
"""
from __future__ import annotations

import torch


class HeadMatmul:
    """logits = x @ Wᵀ for x [B, T, H] and W [V, H] (no bias)."""

    def __init__(self, weight: torch.Tensor):
        self.w = weight.detach()  # [V, H]
        self.cpu = self.w.device.type == "cpu"
        self.wt = self.w.t().contiguous() if self.cpu else None  # [H, V]: the one-row layout (a copy)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        flat = x.reshape(b * t, h).to(self.w.dtype)
        if not self.cpu:
            out = flat @ self.w.t()
        elif b * t == 1:
            out = flat @ self.wt
        else:
            out = (self.w @ flat.t()).t()
        return out.reshape(b, t, -1)

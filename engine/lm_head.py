"""Matmuls in the layout the CPU runs fastest for the number of rows: the LM head, and (fast_linears) every
bias-free linear layer of a float32 model on the CPU.

A decode step feeds one row, a verify pass (or a k-branch draft step) a few. On this CPU the BLAS behind F.linear
is fast for one row only: 2-3 rows cost 1.5-2x one. oneDNN with the weight packed once for 4 rows
(torch.ops.mkldnn, what torch.compile's CPU freezing uses) costs about what one row costs up to ~6 rows, and less
than F.linear for a whole prefill. Its rows do not depend on how many rows are fed (bit for bit), so 2-3 rows are
padded to 4, the cheaper kernel, without changing them. Whole forward of the embedded target on a 200-token
cache, 1 thread, interleaved medians (docs/ab_layouts.py, docs/RESULTS.md §0d):
  tokens                       1      2      3      4      5      6      8
  without the packed copies  59.3   87.0  100.3   91.2  112.4  112.9  115.3 ms
  with them                  58.1   67.0   63.9   62.2   62.5   64.3   75.6 ms
One row keeps x @ Wᵀ with Wᵀ stored contiguous (a matrix-vector product that streams the weight once), which
beats both. The product is the same up to float rounding (the summation order differs between kernels, as it
already does between F.linear's own).

A draft may go further (Bf16Matmul, fast_linears(bf16=True)): its weights streamed in bfloat16, half the bytes.
That is lossless for the output, since only the target decides what is emitted and q is whatever the draft's own
pass gave. It matters on a CPU whose two cores share one memory bus: a draft step streams its weights while the
target's verify pass streams its own, and the target's pass slows by about the bytes the draft moves beside it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

PACK_ROWS = 4  # oneDNN packs each weight for this many rows; fewer rows are padded to it
LAYER_MAX_ROWS = 3  # without oneDNN: (W @ xᵀ)ᵀ up to this many rows, F.linear from there
COPY_BUDGET = 2 << 30  # bytes of copies (packed and transposed layouts) fast_linears may add to a model


def packed_weight(w: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's copy of a float32 CPU weight [N, K] packed for PACK_ROWS rows, or None where this torch has no
    oneDNN (the caller then uses its other layouts)."""
    if w.device.type != "cpu" or w.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)
    except (AttributeError, RuntimeError):  # an op this torch build lacks
        return None


def packed_matmul(flat: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """flat [R, K] @ Wᵀ through the packed weight; R < PACK_ROWS is padded with zero rows (which do not change
    the real rows: tests/test_lm_head.py)."""
    rows = flat.shape[0]
    if rows < PACK_ROWS:
        flat = torch.cat([flat, flat.new_zeros(PACK_ROWS - rows, flat.shape[1])])
    return torch.ops.mkldnn._linear_pointwise(flat, packed, None, "none", [], "")[:rows]


def bf16_supported() -> bool:
    """oneDNN runs bfloat16 matmuls natively on this CPU (avx512_bf16 or AMX); elsewhere it would emulate them."""
    try:
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class Bf16Matmul:
    """out = x @ Wᵀ (float32 in, float32 out) through a bfloat16 copy of W that oneDNN packed once for one row:
    half the bytes of a float32 step to stream. The embedded draft's linears and head on this CPU: 4.6 ms against
    8.1 for float32 x @ Wᵀ (1 row), 4.5 against 14.8 (3 rows) (docs/draft_matmul_kernels.py). Lossy, so for a
    draft only. A gradient to track goes through F.linear on the float32 weight."""

    def __init__(self, weight: torch.Tensor):
        self.w = weight.detach()  # [N, K] float32
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.w.to(torch.bfloat16), 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return F.linear(x, self.w)
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, None, "none", [], "")
        return out.to(self.w.dtype).reshape(*x.shape[:-1], -1)


class HeadMatmul:
    """out = x @ Wᵀ for x [..., H] and W [V, H] (no bias), in the fast layout for the number of rows. A gradient
    to track goes through F.linear. `one_row=False` skips the transposed copy the one-row layout needs, and
    `packed=False` the oneDNN copy (each falls back to F.linear / (W @ xᵀ)ᵀ); `max_rows` caps (W @ xᵀ)ᵀ."""

    def __init__(self, weight: torch.Tensor, max_rows: int | None = None, one_row: bool = True, packed: bool = True):
        self.w = weight.detach()  # [V, H]
        self.cpu = self.w.device.type == "cpu"
        self.max_rows = max_rows
        self.wt = self.w.t().contiguous() if self.cpu and one_row else None  # [H, V]: the one-row layout (a copy)
        self.packed = packed_weight(self.w) if packed else None  # the few-rows layout (a copy), or None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        flat = x.reshape(rows, x.shape[-1]).to(self.w.dtype)
        if not self.cpu:
            out = flat @ self.w.t()
        elif torch.is_grad_enabled() and x.requires_grad:
            out = F.linear(flat, self.w)
        elif rows == 1 and self.wt is not None:
            out = flat @ self.wt
        elif rows > 1 and self.packed is not None:
            out = packed_matmul(flat, self.packed)
        elif rows == 1 or (self.max_rows is not None and rows > self.max_rows):
            out = F.linear(flat, self.w)
        else:
            out = (self.w @ flat.t()).t()
        return out.reshape(*x.shape[:-1], -1)


def fast_linears(model: torch.nn.Module, bf16: bool = False) -> int:
    """Route the bias-free linear layers of a float32 model on the CPU through HeadMatmul (a decode step's one
    row and a verify pass's few rows each in their fast layout), or with bf16 (a draft's, where bf16_supported())
    through Bf16Matmul; the LM head is left to the caller. Adds a packed and a transposed copy of each weight
    (bf16: one half-size copy) while they fit in COPY_BUDGET bytes. Idempotent: a model routed once (e.g. the
    target, when it is also its own draft) keeps its first routing. Returns how many layers were routed."""
    layers = [m for name, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and m.bias is None and "lm_head" not in name
              and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32
              and not getattr(m, "_fast_layout", False)]
    room = COPY_BUDGET
    for m in layers:
        size = m.weight.numel() * m.weight.element_size()
        if bf16:  # one half-size copy, or none past the budget (the layer then stays F.linear in float32)
            if size // 2 <= room:
                room -= size // 2
                m.forward = Bf16Matmul(m.weight)
            m._fast_layout = True
            continue
        packed = size <= room  # the few-rows copy first: verify passes gain most from it
        room -= size * packed
        one_row = size <= room
        room -= size * one_row
        m.forward = HeadMatmul(m.weight, LAYER_MAX_ROWS, one_row, packed)
        m._fast_layout = True
    return len(layers)

"""Matmuls in the layout the CPU runs fastest for the number of rows: the LM head, and (fast_linears) every
bias-free linear layer of a float32 model on the CPU.

A decode step feeds one row, a verify pass (or a k-branch draft step) a few. On this CPU the BLAS behind F.linear
is fast for one row only: 2-3 rows cost 1.5-2x one. oneDNN with the weight packed once for 4 rows
(torch.ops.mkldnn, what torch.compile's CPU freezing uses) costs about what one row costs up to ~6 rows, and less
than F.linear for a whole prefill. Its rows do not depend on how many rows are fed (bit for bit), so 2-3 rows are
padded to 4, the cheaper kernel, without changing them. Whole forward of the embedded target on a 200-token
cache, 1 thread, interleaved medians, on an AVX-512 CPU (docs/models.md):
  tokens                       1      2      3      4      5      6      8
  without the packed copies  59.3   87.0  100.3   91.2  112.4  112.9  115.3 ms
  with them                  58.1   67.0   63.9   62.2   62.5   64.3   75.6 ms
One row keeps x @ Wᵀ with Wᵀ stored contiguous (a matrix-vector product that streams the weight once), which
beats both. On an AVX2 CPU oneDNN's packed kernel costs ~1.8x one row already at 2 rows; there 2-12 rows go through
kernels/panel.py, which streams the weight once for them all. On the later AVX-512 CPU (an Intel Xeon with AMX) the
packed kernel costs 1.3x MKL's one row for 1-6 rows, and panel.py's AVX-512 build less than MKL's one row: there
(Intel's and AMD's AVX-512 CPUs) it takes 1-12 rows, and a verify pass's row gets the bits of a decode step's. The
product is the same up to float rounding (the summation order differs between kernels, as it already does between
F.linear's own).

A draft may go further (fast_linears(kind=...)): its weights streamed in bfloat16 (Bf16Matmul), half the bytes, or
in 4 bits a weight (Int4Matmul), an eighth. That is lossless for the output, since only the target decides what is
emitted and q is whatever the draft's own pass gave. It matters on a CPU whose two cores share one memory bus: a
draft step streams its weights while the target's verify pass streams its own, and the target's pass slows by about
the bytes the draft moves beside it. With 4 bits the target itself becomes a cheap draft (--draft self
--draft-matmul int4): the embedded target's weights came from a 4-bit GGUF (Q4_1: per 32 weights a scale and a
minimum), and Int4Matmul's groups of 32 with a scale and a zero point keep their 4-bit codes (the scales and zero
points are rounded to bfloat16, the kernel's precision).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels import panel

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
    8.1 for float32 x @ Wᵀ (1 row), 4.5 against 14.8 (3 rows) (docs/models.md). Lossy, so for a
    draft only. A gradient to track goes through F.linear on the float32 weight."""

    def __init__(self, weight: torch.Tensor, keep_weight: bool = True):
        self.w = weight.detach() if keep_weight else None  # [N, K] float32, for gradients only
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(torch.bfloat16), 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad and self.w is not None:
            return F.linear(x, self.w)
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, None, "none", [], "")
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)


INT4_GROUP = 32  # weights per scale and zero point: the GGUF Q4_1 block, so the embedded target's weights fit again


def int4_fits(weight: torch.Tensor) -> bool:
    """The CPU int4 kernel takes [N, K] weights with N a multiple of 16 and K of the group size."""
    n, k = weight.shape
    return weight.device.type == "cpu" and n % 16 == 0 and k % INT4_GROUP == 0


INT4_OPS = ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu")  # what Int4Matmul calls


def int4_supported() -> bool:
    """This torch has the CPU kernels for 4-bit weights: both aten ops Int4Matmul calls are registered, each with a CPU
    kernel. Checked, never called: a kernel that is there but raises fails whatever uses it, not reads as absent."""
    has_kernel = getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", lambda op, key: True)
    return all(hasattr(torch.ops.aten, op) and has_kernel(f"aten::{op}", "CPU") for op in INT4_OPS)


class Int4Matmul:
    """out = x @ Wᵀ (float32 in, float32 out) through a 4-bit copy of W: per group of INT4_GROUP weights along a
    row, w ≈ (q - 8)·scale + zero with q in 0..15, min-max rounded, packed once by aten for the CPU kernel. An
    eighth of float32's bytes: the embedded target's 210 linears take 12.7-14.2 ms for one row, casts included,
    against 37.0-39.8 ms in float32 x @ Wᵀ and 26.5-33.3 ms through Bf16Matmul (1 thread, two runs;
    docs/models.md). Lossy, so for a draft only. A gradient to track goes through F.linear on the
    float32 weight."""

    def __init__(self, weight: torch.Tensor, keep_weight: bool = True):
        self.w = weight.detach() if keep_weight else None  # [N, K] float32, for gradients only
        n, k = weight.shape
        groups = weight.detach().reshape(n, k // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)  # a constant group: any scale
        q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        # [K / group, N, 2]: the kernel computes (q - 8)·scale + zero, so zero is the group's value at q = 8. In
        # bfloat16, with a bfloat16 input: the kernel's float32 path is ~30x slower on this CPU (a reference loop)
        self.scales_zeros = torch.stack([scale, low + 8 * scale], -1).transpose(0, 1).contiguous().to(torch.bfloat16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad and self.w is not None:
            return F.linear(x, self.w)
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, INT4_GROUP, self.scales_zeros)
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)


SHORTLIST = 64  # logits a ShortlistHead recomputes in float32


class ShortlistHead:
    """An LM head out = x @ Wᵀ for a 4-bit draft: every logit through a 4-bit copy of W (Int4Matmul), then the
    SHORTLIST largest of each row recomputed from W's float32 rows. The argmax, and the confidences that steer
    drafting, are then float32's wherever float32's argmax is among the 4-bit top SHORTLIST (every position of the
    tuning prompts' greedy continuations: docs/models.md), at a 4-bit matmul's cost (49k rows: ~2 ms
    against ~5.5 for float32 x @ Wᵀ, 1 thread). The other logits keep the 4-bit rounding; lossless all the same, since
    q is whatever this head gives (tests/test_lm_head.py). A gradient to track goes through F.linear."""

    def __init__(self, weight: torch.Tensor, shortlist: int = SHORTLIST):
        self.w = weight.detach()  # [V, H] float32: the rows the shortlist is recomputed from (the target's, shared)
        self.coarse = Int4Matmul(self.w, keep_weight=False)
        self.shortlist = min(shortlist, self.w.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return F.linear(x, self.w)
        flat = x.reshape(-1, x.shape[-1])  # [R, H]
        out = self.coarse(flat)  # [R, V]
        top = out.topk(self.shortlist, -1).indices  # [R, S]
        exact = torch.einsum("rh,rsh->rs", flat.to(self.w.dtype), self.w[top])  # [R, S]: the float32 rows' products
        return out.scatter_(-1, top, exact.to(out.dtype)).reshape(*x.shape[:-1], -1)


def draft_matmul(kind: str, weight: torch.Tensor, head: bool = False, keep_weight: bool = True):
    """The matmul a draft's weight goes through for a kind of models.draft_matmul_kind. int4 takes the weights that
    its kernel fits (int4_fits): the decoder layers' through Int4Matmul, and the LM head (head=True) through
    ShortlistHead, whose largest logits are float32's: the head decides the draft's argmax. For the embedded target as
    its own draft, greedy agreement with the target was 0.996 with a float32 head, 0.975 with a bfloat16 one and 0.900
    with a plain 4-bit one, a draft step 25.7, 20.9 and 19.8 ms (docs/models.md; the shortlist
    head's figures are in docs/models.md). keep_weight=False: a bfloat16 or 4-bit matmul keeps no reference to
    the float32 weight (a fused copy made for it is then freed; gradients cannot flow through it)."""
    if kind == "int4" and int4_fits(weight):
        return ShortlistHead(weight) if head else Int4Matmul(weight, keep_weight)
    return Bf16Matmul(weight, keep_weight) if kind == "bfloat16" else HeadMatmul(weight)


class HeadMatmul:
    """out = x @ Wᵀ for x [..., H] and W [V, H] (no bias), in the fast layout for the number of rows. A gradient
    to track goes through F.linear. `one_row=False` skips the transposed copy the one-row layout needs, `panels=False`
    the few-rows copy of the panel kernel (kernels/panel.py: 2-12 rows where it builds, and one row too where it
    serves_one_row), and `packed=False` the oneDNN copy (each falls back to F.linear / (W @ xᵀ)ᵀ); `max_rows` caps
    (W @ xᵀ)ᵀ."""

    def __init__(
        self,
        weight: torch.Tensor,
        max_rows: int | None = None,
        one_row: bool = True,
        packed: bool = True,
        panels: bool = True,
    ):
        self.w = weight.detach()  # [V, H]
        self.cpu = self.w.device.type == "cpu"
        self.max_rows = max_rows
        # [V / 16, H, 16]: the 2-12 rows layout (a copy; one row too where the kernel serves it), or None
        self.panels = panel.pack(self.w) if panels and panel.fits(self.w) and panel.available() else None
        self.first_row = 1 if self.panels is not None and panel.serves_one_row() else 2  # rows the panels start at
        one_row = one_row and self.first_row == 2  # the one-row layout where the panels do not take one row
        self.wt = self.w.t().contiguous() if self.cpu and one_row else None  # [H, V]: the one-row layout (a copy)
        self.packed = packed_weight(self.w) if packed else None  # the few-rows layout (a copy), or None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        flat = x.reshape(rows, x.shape[-1]).to(self.w.dtype)
        if not self.cpu:
            out = flat @ self.w.t()
        elif torch.is_grad_enabled() and x.requires_grad:
            out = F.linear(flat, self.w)
        elif self.first_row <= rows <= panel.MAX_ROWS and self.panels is not None and not torch.compiler.is_compiling():
            out = panel.matmul(flat, self.panels)
        elif rows == 1 and self.wt is not None:
            out = flat @ self.wt
        elif rows > 1 and self.packed is not None:
            out = packed_matmul(flat, self.packed)
        elif rows == 1 or (self.max_rows is not None and rows > self.max_rows):
            out = F.linear(flat, self.w)
        else:
            out = (self.w @ flat.t()).t()
        return out.reshape(*x.shape[:-1], -1)


def fast_linears(model: torch.nn.Module, kind: str = "float32") -> int:
    """Route the bias-free linear layers of a float32 model on the CPU through HeadMatmul (a decode step's one
    row and a verify pass's few rows each in their fast layout), or for a draft (kind "bfloat16" or "int4", see
    models.draft_matmul_kind) through draft_matmul; the LM head is left to the caller. Adds a panel, a packed
    and a transposed copy of each weight (a draft: one smaller copy) while they fit in COPY_BUDGET bytes. Idempotent: a
    model routed once keeps its first routing. Returns how many layers were routed."""
    layers = [
        m
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
        and m.bias is None
        and "lm_head" not in name
        and m.weight.device.type == "cpu"
        and m.weight.dtype == torch.float32
        and not getattr(m, "_fast_layout", False)
    ]
    room = COPY_BUDGET
    for m in layers:
        size = m.weight.numel() * m.weight.element_size()
        if kind != "float32":  # one smaller copy, or none past the budget (the layer then stays F.linear in float32)
            if size // 2 <= room:
                room -= size // 2
                m.forward = draft_matmul(kind, m.weight)
            m._fast_layout = True
            continue
        few = size <= room and panel.fits(m.weight) and panel.available()  # the 2-12 rows copy first: verify passes
        room -= size * few
        packed = size <= room  # then the oneDNN copy, for more rows (a prefill, a long block)
        room -= size * packed
        one_row = size <= room and not (few and panel.serves_one_row())  # the panels may take one row already
        room -= size * one_row
        m.forward = HeadMatmul(m.weight, LAYER_MAX_ROWS, one_row, packed, few)
        m._fast_layout = True
    return len(layers)

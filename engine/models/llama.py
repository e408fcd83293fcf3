"""One Llama decoder layer, its kernels swappable, and the token trees a verify pass may carry.

Every fast path runs `decoder_layer`: the target's static forward (static_forward.StaticLlama, transformers' own
modules and attention function, bit for bit), a lean draft (lean.LeanLlama: q, k, v and gate, up fused, read through
lm_head's float32, bfloat16 or int4 matmuls) and the static-shape decoder for GPUs (lean.GenericDecoder: the model's
weights through F.linear, K and V written in place at tensor positions). What differs between them is a LayerWeights
(how each product and norm runs) and two callables: `store`, which writes the new tokens' K and V and returns what
they attend to, and `attend`, the attention itself. gpt-fast has one `Transformer`; here the one thing is the layer.

A TokenTree says how a pass's new tokens hang together where they are not one line: SpecBranch's target verifies
the pending path and the fork's k branches in one pass (engine/methods/parallel.py), each branch seeing the path and
its own tokens only, at the rotary positions it would have alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

Kernel = Callable[[torch.Tensor], torch.Tensor]


class Heads(NamedTuple):
    q: int  # query heads
    kv: int  # key/value heads (grouped-query attention: q // kv query heads share one)
    dim: int  # head dimension


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights, each read through its kernel: x [..., H] in, as the shapes say out."""

    attn_norm: Kernel  # [..., H] -> [..., H]
    qkv: Kernel  # [..., H] -> [..., (Hq + 2 Hkv) D]: q, k and v in one product (or three, concatenated)
    o: Kernel  # [..., Hq D] -> [..., H]
    mlp_norm: Kernel  # [..., H] -> [..., H]
    gate_up: Kernel  # [..., H] -> [..., 2 I]: gate and up in one product
    down: Kernel  # [..., I] -> [..., H]
    act: Kernel = F.silu


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half: halves, not interleaved pairs."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb arithmetic on one tensor (q and k stacked: elementwise, the same bits)."""
    return (x * cos) + (rotate_half(x) * sin)


def decoder_layer(
    x: torch.Tensor,
    w: LayerWeights,
    heads: Heads,
    cos: torch.Tensor,
    sin: torch.Tensor,
    store: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """x [R, n, H] -> [R, n, H]: LlamaDecoderLayer's arithmetic, op for op. cos, sin broadcast over [R, heads, n, D];
    store(k, v) takes the new tokens' K and V [R, Hkv, n, D] and returns the K and V they attend to [R, Hkv, S, D];
    attend(q [R, Hq, n, D], K, V) -> [R, n, Hq D]."""
    r, n, _ = x.shape
    hq, hkv, d = heads
    qkv = w.qkv(w.attn_norm(x)).view(r, n, hq + 2 * hkv, d).transpose(1, 2)  # [R, Hq + 2 Hkv, n, D]
    qk = apply_rotary(qkv[:, : hq + hkv], cos, sin)  # q and k in one pass
    k, v = store(qk[:, hq:], qkv[:, hq + hkv :])
    x = x + w.o(attend(qk[:, :hq], k, v))
    gate, up = w.gate_up(w.mlp_norm(x)).chunk(2, -1)
    return x + w.down(w.act(gate) * up)


def grouped_attention(mask: torch.Tensor | None, scale: float | None = None):
    """attend() for decoder_layer without repeating K and V for grouped-query attention: the rep query heads that
    share a KV head are stacked as rows of one head, so `mask` is bool [rep · n, S] (rows repeated per group) or None
    (every new token sees every key)."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        r, hq, n, d = q.shape
        hkv = k.shape[1]
        o = F.scaled_dot_product_attention(q.reshape(r, hkv, hq // hkv * n, d), k, v, attn_mask=mask, scale=scale)
        # [R, Hkv, rep · n, D] -> [R, n, Hq D]; reshape, not view: a CUDA kernel may return o non-contiguous
        return o.reshape(r, hq, n, d).transpose(1, 2).reshape(r, n, hq * d)

    return attend


@dataclass(frozen=True)
class TokenTree:
    """How the T new tokens of a pass hang together: parents[j] is the index of token j's parent among them, -1 for
    the last position already in the cache. A line is parents (-1, 0, 1, ...); SpecBranch's tree is the committed
    tokens and the path as a line, then each of the k branches as a line hanging off the path's last token.
    Token j sees the cache and its own ancestors among the new tokens, and takes the rotary position of its depth."""

    parents: tuple[int, ...]

    def __post_init__(self):
        for j, p in enumerate(self.parents):
            if not -1 <= p < j:
                raise ValueError(f"token {j}'s parent {p} is not an earlier token of the pass (or -1)")

    @classmethod
    def line(cls, n: int) -> TokenTree:
        return cls(tuple(range(-1, n - 1)))

    @property
    def is_line(self) -> bool:
        return all(p == j - 1 for j, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Each token's depth below the cache: 0 for a child of the last cached position."""
        out: list[int] = []
        for p in self.parents:
            out.append(0 if p < 0 else out[p] + 1)
        return out

    def ancestors(self, j: int) -> list[int]:
        """Token j's line among the new tokens, from the first to j itself."""
        line = []
        while j >= 0:
            line.append(j)
            j = self.parents[j]
        return line[::-1]

    def positions(self, start: int, device=None) -> torch.Tensor:
        """The rotary positions [T] of the new tokens after `start` cached ones."""
        return start + torch.tensor(self.depths(), dtype=torch.long, device=device)

    def sees(self, start: int, device=None) -> torch.Tensor:
        """bool [T, start + T]: which positions each new token attends to (the cache, then its ancestors and itself)."""
        t = len(self.parents)
        own = torch.zeros(t, t, dtype=torch.bool)
        for j in range(t):
            own[j, self.ancestors(j)] = True
        return torch.cat([torch.ones(t, start, dtype=torch.bool), own], 1).to(device)

"""The target's forward: transformers' Llama forward, op for op, over a KV cache where rollback is a pointer.

Why: a 1-token step of the embedded target spent 12-21 ms of its ~47 in `aten::cat` (torch.profiler, 200 tokens in the
cache): transformers' DynamicCache concatenates every layer's whole K and V into new tensors at every step, and a
verify pass that is rolled back does it again. Beside a draft running in the same process the step took 61-72 ms,
against 52 ms with the draft in another process: those allocations and copies, and the forward's per-call machinery
(decorators, output hooks, mask building per call), contend with the draft's thread (docs/RESULTS.md §0r).

Here K and V are written into lean.KVBuffer's buffers, allocated once, and attention reads a view of them, so a step
copies only its own new rows. Every other op is the one transformers runs, on the same values in the same order: the
same modules' forwards (the routed linear layers of lm_head.fast_linears included), its rotary embedding and
apply_rotary_pos_emb, its attention function (sdpa) with the mask transformers would build (none for one token or
for a pass from position 0, where sdpa's causal flag takes over; else a bool mask over the cached positions). So the
logits, the features and the hidden states are bit-identical to `model.base_model`'s
(tests/test_static_forward.py checks torch.equal over prefill, 1-token and multi-token passes and rollbacks): the
target's output, and so the exactness of every method, does not depend on which forward runs.
"""
from __future__ import annotations

import torch

from .lean import CAPACITY, KVBuffer, fits as lean_misfit


def fits(model) -> str | None:
    """Why `model` cannot run this path, or None: a Llama decoder that lean.fits, on the CPU (the only place the
    equality with transformers' forward was checked), whose attention is transformers' sdpa function (StaticLlama.mask
    builds the masks it is given)."""
    why = lean_misfit(model)
    if why:
        return why
    if next(model.parameters()).device.type != "cpu":
        return "not on the CPU"
    attention = getattr(model.config, "_attn_implementation", None)
    if attention != "sdpa":
        return f"attention {attention}"
    return None


class StaticLlama:
    """forward(input_ids [B, T], cache: KVBuffer, hidden_states) -> (the final-norm hidden states [B, T, H], and
    with hidden_states the per-layer states as transformers returns them: the embeddings, each layer's output but the
    last, then the final-norm states). Holds the model's modules, no copies of their weights."""

    def __init__(self, model):
        why = fits(model)
        if why:
            raise ValueError(f"the static-cache forward does not fit this model: {why}")
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
        self.model = model.model
        self.attention = ALL_ATTENTION_FUNCTIONS["sdpa"]
        self.rotary = apply_rotary_pos_emb
        self.layers = list(self.model.layers[: model.config.num_hidden_layers])
        first = self.layers[0].self_attn
        self.kv_heads = model.config.num_key_value_heads
        self.head_dim = first.head_dim

    def new_cache(self, capacity: int = CAPACITY) -> KVBuffer:
        norm = self.model.norm.weight
        return KVBuffer(len(self.layers), self.kv_heads, self.head_dim, norm.dtype, norm.device, capacity)

    @staticmethod
    def mask(start: int, t: int, device) -> torch.Tensor | None:
        """What transformers' create_causal_mask gives sdpa here: None for one new token (it sees everything) or for
        a pass from position 0 (sdpa's is_causal does it); else bool [1, 1, T, start + T], query i seeing keys up to
        start + i."""
        if t == 1 or start == 0:
            return None
        keys = torch.arange(start + t, device=device)
        return (keys[None, :] <= (start + torch.arange(t, device=device))[:, None])[None, None]

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, cache: KVBuffer, hidden_states: bool = False):
        b, t = input_ids.shape
        if cache.rows != b:
            raise ValueError(f"the cache holds {cache.rows} rows, fed {b}")
        start = cache.length
        cache.reserve(t)
        x = self.model.embed_tokens(input_ids)  # [B, T, H]
        position_ids = (torch.arange(t, device=x.device) + start).unsqueeze(0)
        cos, sin = self.model.rotary_emb(x, position_ids)
        mask = self.mask(start, t, x.device)
        shape = (b, t, -1, self.head_dim)
        hidden = [x] if hidden_states else None
        for i, layer in enumerate(self.layers):  # LlamaDecoderLayer.forward and LlamaAttention.forward, inlined
            a, mlp = layer.self_attn, layer.mlp
            h = layer.input_layernorm.forward(x)
            q = a.q_proj.forward(h).view(shape).transpose(1, 2)  # [B, Hq, T, D]
            k = a.k_proj.forward(h).view(shape).transpose(1, 2)  # [B, Hkv, T, D]
            v = a.v_proj.forward(h).view(shape).transpose(1, 2)
            q, k = self.rotary(q, k, cos, sin)
            k, v = cache.write(i, k, v)  # [B, Hkv, start + T, D]: views of the buffers
            o, _ = self.attention(a, q, k, v, mask, dropout=0.0, scaling=a.scaling)  # [B, T, Hq, D]
            x = x + a.o_proj.forward(o.reshape(b, t, -1).contiguous())
            h = layer.post_attention_layernorm.forward(x)
            x = x + mlp.down_proj.forward(mlp.act_fn(mlp.gate_proj.forward(h)) * mlp.up_proj.forward(h))
            if hidden is not None:
                hidden.append(x)
        cache.advance(t)
        x = self.model.norm.forward(x)
        if hidden is not None:
            hidden[-1] = x  # transformers ties the last hidden state to the final-norm one
        return x, (tuple(hidden) if hidden is not None else None)

"""The target's forward: transformers' Llama forward, op for op, with q, k, v and gate, up each as one stacked matmul,
over a KV cache where rollback is a pointer.

Why: a target step on the CPU is mostly matmuls of a few rows, streaming the weights: transformers' forward runs seven a
layer (210 for the embedded target). Stacking q, k and v into one weight, and gate and up into another, makes it four
(120), each output column the same dot product as in its own layer. A 1-token step of the embedded target took 42
against 50 ms (medians of 75 alternated), and `ar` ran 1.12-1.23x as fast in the bench (docs/models.md). Writing
K and V in place instead of transformers' DynamicCache concatenation, and skipping the forward's per-call machinery,
measured no faster alone (docs/models.md); they stay because the path needs its own loop anyway.

Exactness: every other op is the one transformers runs, on the same values in the same order: the same modules' forwards
(the routed linear layers of lm_head.fast_linears), the rotary embedding's table and apply_rotary_pos_emb's arithmetic
(on q and k in one pass: elementwise, so the same bits), its attention function (sdpa) with the mask transformers would
build (none for one new token or for a pass from position 0, where sdpa's causal flag takes over; else a bool mask over
the cached positions). One exception, checked like the rest: with a mask, transformers copies each KV head for the query
heads that share it (repeat_kv) before sdpa, and the path hands sdpa the KV heads with enable_gqa instead
(StaticLlama.grouped, turned off where agrees() finds other bits), the same attention without the copies: 45 against 96
µs a layer for a 4-token pass over 250 positions, bit for bit on this CPU (docs/models.md). So the logits, the features
and the hidden states are bit-identical to `model.base_model`'s (tests/test_static_forward.py checks torch.equal over
prefill, 1-token and multi-token passes and rollbacks). A BLAS could in principle sum a stacked matmul's columns
otherwise than the separate ones': the path checks the bits against transformers' forward when it is built
(StaticLlama.agrees) and is not used where they differ, so the target's output, and the exactness of every method, never
depends on which forward runs.

All of the above is the CPU's ("cpu" kernels). Elsewhere (a GPU), or asked for (kernels="generic"), the path runs
lean.GenericDecoder: the model's own weights through F.linear in its own dtype (no stacked copies), K and V in buffers
of a fixed capacity written in place at positions given as a tensor, attention over the whole buffer through a mask
made from those positions: static shapes, no host read, so that its one-token steps and verify passes (at most
lean.GRAPH_TOKENS tokens) compile with torch.compile(mode="reduce-overhead") into CUDA graphs, on CUDA by default
(lean.compile_mode). Its states equal transformers' up to float rounding (attention sums over the masked positions
too), not bit for bit: StaticLlama.agrees then checks closeness, not equality.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.lm_head import COPY_BUDGET, LAYER_MAX_ROWS, HeadMatmul
from engine.models.cache import new_cache as transformers_cache
from engine.models.lean import CAPACITY, GenericDecoder, KVBuffer, compile_mode, default_kernels
from engine.models.lean import fits as lean_misfit
from engine.models.llama import Heads, LayerWeights, TokenTree, decoder_layer

AUTO = "auto"  # compiled: by device (CUDA graphs on CUDA, none on the CPU)


def fits(model, kernels: str | None = None) -> str | None:
    """Why `model` cannot run this path, or None: a Llama decoder that lean.fits. With the CPU's kernels (the default
    on the CPU, default_kernels) on the CPU (the only place their bit-equality with transformers' forward was checked),
    and with attention through transformers' sdpa function (StaticLlama.mask builds the masks it is given); the
    generic kernels compute attention themselves, on any device."""
    why = lean_misfit(model)
    if why:
        return why
    device = next(model.parameters()).device
    if (kernels or default_kernels(device)) == "generic":
        return None
    if device.type != "cpu":
        return "not on the CPU"
    attention = getattr(model.config, "_attn_implementation", None)
    if attention != "sdpa":
        return f"attention {attention}"
    return None


def fuse(linears: list, room: int):
    """One matmul for linear layers that read the same input (q, k and v; gate and up): their weights stacked, in the
    layouts fast_linears gave each of them (copies while they fit in `room` bytes). Each output column is the same dot
    product as in its own layer's matmul; StaticLlama.agrees checks that the bits match on this machine. Where the
    layers were not routed alike, the separate matmuls, concatenated. Returns (the matmul, bytes of copies)."""
    routed = [m.forward for m in linears]
    separate = (lambda x: torch.cat([r(x) for r in routed], -1)), 0
    if (
        not all(isinstance(r, HeadMatmul) and r.cpu for r in routed)
        or len({(r.wt is None, r.packed is None, r.panels is None) for r in routed}) > 1
    ):
        return separate
    one_row, packed, panels = (x is not None for x in (routed[0].wt, routed[0].packed, routed[0].panels))
    size = sum(m.weight.numel() * m.weight.element_size() for m in linears) * (1 + one_row + packed + panels)
    if size > room:
        return separate
    weight = torch.cat([m.weight for m in linears]).detach()
    return HeadMatmul(weight, LAYER_MAX_ROWS, one_row, packed, panels), size


def static_llama(model, kernels: str | None = None) -> StaticLlama | None:
    """The model's static-cache forward with `kernels` (default_kernels(its device) unless given), built and checked
    against transformers' forward (StaticLlama.agrees) once per model and kernels, however many LMs wrap it
    (models.pair_of re-wraps a target for a draft's vocabulary); None where they differ on this machine."""
    kernels = kernels or default_kernels(next(model.parameters()).device)
    built = model.__dict__.setdefault("_static_forward", {})
    if kernels not in built:
        path = StaticLlama(model, kernels)
        if path.grouped and not path.agrees(model):
            path.grouped = False  # a CPU whose sdpa sums grouped heads otherwise: transformers' copies, then
        built[kernels] = path if path.agrees(model) else None
    return built[kernels]


class StaticLlama:
    """forward(input_ids [B, T], cache: KVBuffer, hidden_states) -> (the final-norm hidden states [B, T, H], and
    with hidden_states the per-layer states as transformers returns them: the embeddings, each layer's output but the
    last, then the final-norm states). Holds the model's modules, and stacked copies of q, k, v and gate, up."""

    def __init__(self, model, kernels: str | None = None, compiled: bool | str = AUTO):
        """kernels: "cpu" (the stacked matmuls through lm_head's layouts, bit-identical to transformers) or "generic"
        (lean.GenericDecoder, any device); default_kernels(the model's device) unless given. compiled (generic only):
        the steps through torch.compile in compile_mode(device); AUTO: on CUDA (CUDA graphs), not on the CPU. They
        compile on the thread that will call them (compile_here, on the model's worker), not here: CUDA graph trees
        keep their state per thread."""
        device = next(model.parameters()).device
        self.kernels = kernels or default_kernels(device)
        if self.kernels not in ("cpu", "generic"):
            raise ValueError(f"unknown kernels {self.kernels!r}; cpu or generic")
        why = fits(model, self.kernels)
        if why:
            raise ValueError(f"the static-cache forward does not fit this model: {why}")
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.config = model.config
        self.model = model.model
        self.attention = ALL_ATTENTION_FUNCTIONS["sdpa"]
        # a masked pass's attention through sdpa's enable_gqa on the KV heads, not transformers' repeated copies of
        # them (static_llama turns it off where agrees() finds other bits)
        self.grouped = model.config.num_key_value_heads < model.config.num_attention_heads
        self.layers = list(self.model.layers[: model.config.num_hidden_layers])
        first = self.layers[0].self_attn
        self.heads = Heads(model.config.num_attention_heads, model.config.num_key_value_heads, first.head_dim)
        self.weights: list[LayerWeights] = []
        self.generic, self.compiles_here = None, False
        if self.kernels == "generic":
            self.generic = GenericDecoder(model, len(self.layers))
            self.compiles_here = compiled is True or (compiled == AUTO and compile_mode(device) == "reduce-overhead")
            return
        room = COPY_BUDGET
        for layer in self.layers:
            a, mlp = layer.self_attn, layer.mlp
            qkv, used = fuse([a.q_proj, a.k_proj, a.v_proj], room)
            gate_up, more = fuse([mlp.gate_proj, mlp.up_proj], room - used)
            room -= used + more
            # the modules' own forwards (fast_linears has routed the linear ones) and norms: transformers' bits
            self.weights.append(
                LayerWeights(
                    layer.input_layernorm.forward,
                    qkv,
                    a.o_proj.forward,
                    layer.post_attention_layernorm.forward,
                    gate_up,
                    mlp.down_proj.forward,
                    mlp.act_fn,
                )
            )

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def compile_here(self) -> None:
        """Compile the generic steps for this thread, where asked, and warm up the one-token step here (each other
        shape compiles at its first use, on the thread that calls it)."""
        if self.compiles_here and self.generic._graph is None and not self.generic.compile_why:
            self.generic.compile()
            self.generic.warm_up(self.new_cache())

    @property
    def compile_why(self) -> str:
        """Why the generic steps run eager though compiled ("" else)."""
        return self.generic.compile_why if self.generic is not None else ""

    def new_cache(self, capacity: int | None = None) -> KVBuffer:
        if self.generic is not None:  # static: the context's positions from the start (GenericDecoder.new_cache)
            return self.generic.new_cache(capacity)
        norm = self.model.norm.weight
        return KVBuffer(len(self.layers), self.heads.kv, self.heads.dim, norm.dtype, norm.device, capacity or CAPACITY)

    @staticmethod
    def mask(start: int, t: int, device, tree: TokenTree | None = None) -> torch.Tensor | None:
        """What transformers' create_causal_mask gives sdpa here: None for one new token (it sees everything) or for
        a pass from position 0 (sdpa's is_causal does it); else bool [1, 1, T, start + T], query i seeing keys up to
        start + i. A tree (not a line): each new token sees the cache and its ancestors (TokenTree.sees)."""
        if tree is not None and not tree.is_line:
            return tree.sees(start, device)[None, None]
        if t == 1 or start == 0:
            return None
        keys = torch.arange(start + t, device=device)
        return (keys[None, :] <= (start + torch.arange(t, device=device))[:, None])[None, None]

    @torch.inference_mode()
    def __call__(
        self, input_ids: torch.Tensor, cache: KVBuffer, hidden_states: bool = False, tree: TokenTree | None = None
    ):
        """input_ids [B, T] -> (final-norm states [B, T, H], per-layer states or None), appending T positions. `tree`:
        how the T new tokens hang together where they are not a line (one row only)."""
        if self.generic is not None:
            return self.generic(input_ids, cache, hidden_states, tree)
        b, t = input_ids.shape
        if cache.rows != b:
            raise ValueError(f"the cache holds {cache.rows} rows, fed {b}")
        start = cache.length
        cache.reserve(t)
        x = self.model.embed_tokens(input_ids)  # [B, T, H]
        if tree is None or tree.is_line:
            position_ids = (torch.arange(t, device=x.device) + start).unsqueeze(0)
        else:
            position_ids = tree.positions(start, x.device).unsqueeze(0)
        cos, sin = self.model.rotary_emb(x, position_ids)  # [1, T, D]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        mask = self.mask(start, t, x.device, tree)
        hidden = [x] if hidden_states else None
        for i, (layer, w) in enumerate(zip(self.layers, self.weights)):

            def store(k, v, i=i):
                return cache.write(i, k, v)  # [B, Hkv, start + T, D]: views of the buffers

            def attend(q, k, v, a=layer.self_attn):  # transformers' sdpa attention: [B, T, Hq, D] -> [B, T, Hq D]
                if mask is not None and self.grouped:  # q [B, Hq, T, D] on k, v [B, Hkv, S, D], unrepeated
                    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=a.scaling, enable_gqa=True)
                    return o.transpose(1, 2).reshape(b, t, -1)  # [B, T, Hq D], contiguous as transformers' is
                o, _ = self.attention(a, q, k, v, mask, dropout=0.0, scaling=a.scaling)
                return o.reshape(b, t, -1).contiguous()

            x = decoder_layer(x, w, self.heads, cos, sin, store, attend)
            if hidden is not None:
                hidden.append(x)
        cache.advance(t)
        x = self.model.norm.forward(x)
        if hidden is not None:
            hidden[-1] = x  # transformers ties the last hidden state to the final-norm one
        return x, (tuple(hidden) if hidden is not None else None)

    @torch.inference_mode()
    def agrees(self, model, seed: int = 0) -> bool:
        """Whether this path gives transformers' bits on this machine: a prefill, a 1-token step and a 3-token pass
        of random tokens, each path with its own cache. Where a BLAS computed a stacked matmul's columns otherwise
        than the separate ones, it would not, and the target keeps transformers' forward (models.LM). The generic
        kernels are not bit-identical (attention sums over masked positions too): for them, within close()."""
        ids = torch.randint(0, self.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(seed))
        ids = ids.to(self.device)
        mine, theirs = self.new_cache(), transformers_cache(model)
        for lo, hi in ((0, 8), (8, 9), (9, 12)):
            want = model.base_model(input_ids=ids[:, lo:hi], past_key_values=theirs, use_cache=True).last_hidden_state
            got = self(ids[:, lo:hi], mine)[0]
            if not (torch.equal(got, want) if self.kernels == "cpu" else close(got, want)):
                return False
        return True


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal up to float rounding, for the generic kernels' probe: the largest difference within a small share of the
    largest value (1e-4 in float32, 5e-2 in a 16-bit dtype, whose rounding the layers compound)."""
    share = 1e-4 if want.dtype == torch.float32 else 5e-2
    scale = want.float().abs().max().clamp_min(1e-6)
    return bool((got.float() - want.float()).abs().max() <= share * scale)

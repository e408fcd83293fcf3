"""A lean decode path for a Llama draft, in gpt-fast's shape: fused matmuls and a KV cache where rollback is a
pointer.

Why: the 4-bit self-draft is the slower side of an overlapped round (docs/models.md), and of its ~28 ms step
only 6.6 ms were the 4-bit products. The rest was the float32 head (5.4 ms; it stays in models.LM, a
lm_head.ShortlistHead since docs/models.md) and transformers' forward around the products: the KV cache's `cat` (each
step
copies every layer's whole cache, 4.1 ms) and ~10 ms of per-op overhead (seven linear layers a layer, each casting
to bfloat16 and back, the rotary embedding applied to q and to k apart, a mask built per call). Here a layer runs
four matmuls (q, k and v fused into one weight, gate and up into another), the rotary embedding is applied to q
and k in one pass over a precomputed table, and K and V are written into buffers allocated once, so a step copies
only its own new rows.
Rolling back moves a pointer. A fork copies nothing (BranchKV): its k branches share the positions held when it
forked, and a branch step attends to them once for all k branches.

The weights are the model's own tensors read through lm_head.draft_matmul (4-bit groups keep the same codes when
rows are stacked, since a group runs along a row). Only a draft runs this path: the target keeps transformers'
forward, and output stays exact whatever the draft computes (q is the draft's own distribution from this pass).

With compiled=True (--draft-forward lean-compiled) a one-token step on one branch, the step a draft takes most,
runs through torch.compile (inductor's C++ kernels fuse the norms, the rotary embedding and the MLP's gate into
few loops): about a fifth of the step was per-op overhead around the matmuls (docs/models.md). Its floats
differ from the eager step's by rounding; q is still what the pass that drafted the token computed.

Kernels. What is above is the CPU's ("cpu" kernels: lm_head's oneDNN-packed, bfloat16 and int4 matmuls, a cache whose
writes and masks are cut to the positions held). Elsewhere (a GPU), or asked for (kernels="generic"), the same decoder
runs GenericDecoder: the model's own weights through F.linear in its own dtype, and a step with static shapes in
gpt-fast's way, so that torch.compile(mode="reduce-overhead") can capture it as a CUDA graph: K and V buffers of a
fixed capacity allocated once (GENERIC_CAPACITY, with static addresses, reused by the next cache once one is dropped),
written in place at positions given as a tensor (index_copy_), attention over the whole buffer with a mask computed in
the step from those positions, and no host read inside the step. The static target (static_forward.py) runs the same
GenericDecoder there.
"""

from __future__ import annotations

import threading
import time
import types
import weakref

import torch
import torch.nn.functional as F

from engine.kernels.lm_head import draft_matmul
from engine.models.cache import cropped_length
from engine.models.llama import Heads, LayerWeights, TokenTree, decoder_layer, grouped_attention

CAPACITY = 256  # positions a new cache holds before it grows (doubling: amortised, and rare in a chat)
# the torch threads a compiled step runs on: the workers' count, a solo step's too (12 ms on 1 against 17 ms eager on
# 2, docs/models.md)
STEP_THREADS = 1
GENERIC_CAPACITY = 4096  # positions a generic-kernel cache holds from the start (gpt-fast's max_seq_length): a step's
# shapes stay the same until a sequence outgrows it (then it grows by doubling, and a compiled step records anew)
GRAPH_TOKENS = 16  # a generic step of at most this many new tokens (all rows) runs compiled, where compiled: one-token
# steps, a fork's k-row steps, verify passes; a longer one (a prefill) runs eager


def heads_of(config) -> Heads:
    """A Llama config's attention shape."""
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return Heads(config.num_attention_heads, config.num_key_value_heads, dim)


def default_kernels(device) -> str:
    """The kernels a decode path reads its weights through on `device`: "cpu" (lm_head's CPU matmuls, the cache cut
    to the positions held) on the CPU, "generic" (GenericDecoder: F.linear, static shapes) elsewhere."""
    return "cpu" if torch.device(device).type == "cpu" else "generic"


def compile_mode(device) -> str:
    """The torch.compile mode a step compiles in on `device`: "reduce-overhead" on CUDA (the step captured as a CUDA
    graph and replayed: no per-op launches), "default" elsewhere (inductor's kernels; on the CPU today's)."""
    return "reduce-overhead" if torch.device(device).type == "cuda" else "default"


def fits(model) -> str | None:
    """Why `model` cannot run this path, or None when it can: a Llama decoder (RMSNorm, SiLU gate, rotary
    embeddings whose table does not depend on the sequence length), no biases, every layer full attention."""
    config = getattr(model, "config", None)
    if type(model).__name__ != "LlamaForCausalLM" or config is None:
        return f"{type(model).__name__} is not a LlamaForCausalLM"
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    reasons = {
        "attention_bias": getattr(config, "attention_bias", False),
        "mlp_bias": getattr(config, "mlp_bias", False),
        f"hidden_act {config.hidden_act}": config.hidden_act != "silu",
        f"rope_type {rope}": rope in ("dynamic", "longrope"),
        "pretraining_tp": getattr(config, "pretraining_tp", 1) != 1,
    }
    bad = [name for name, flag in reasons.items() if flag]
    return ", ".join(bad) or None


class KVBuffer:
    """K and V of every layer in buffers allocated once, [B, kv_heads, capacity, head_dim] each; positions
    [0, length) hold tokens. The surface engine.models.cache and the parallel loop use (get_seq_length, crop,
    batch_repeat_interleave, batch_select_indices) works as on a transformers cache."""

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        capacity: int = CAPACITY,
        static: bool = False,
        buffers: tuple[list, list] | None = None,
    ):
        """static: for GenericDecoder's steps, which attend over whole buffers: every buffer is marked as a static
        address (a CUDA graph reads and writes it in place), and room made by a fork is zeros, never left empty (a
        masked position must hold a finite value). buffers: (keys, values) of a cache that is gone, reused."""
        self.static = static
        shape = (1, kv_heads, capacity, head_dim)
        if buffers is not None:
            self.keys, self.values = buffers
        else:
            with torch.inference_mode(False):  # plain tensors (see reserve)
                self.keys = [self._mark(torch.zeros(shape, dtype=dtype, device=device)) for _ in range(layers)]
                self.values = [self._mark(torch.zeros(shape, dtype=dtype, device=device)) for _ in range(layers)]
        self.length = 0

    def _mark(self, t: torch.Tensor) -> torch.Tensor:
        """A buffer of a static cache is marked as a static address for torch.compile (unguarded: a new address makes
        a CUDA graph record anew, not compile anew), as transformers' StaticCache does."""
        if self.static:
            torch._dynamo.mark_static_address(t)
        return t

    def _new(self, t: torch.Tensor, rows: int) -> torch.Tensor:
        """A buffer like t with `rows` rows: zeros in a static cache (read, masked, by whole-buffer attention), else
        left empty (written before it is read)."""
        return self._mark((t.new_zeros if self.static else t.new_empty)(rows, *t.shape[1:]))

    def positions(self, t: int) -> torch.Tensor:
        """The rotary positions of a step's t new tokens a row: [t]."""
        return self.length + torch.arange(t, device=self.keys[0].device)

    def shared_length(self) -> int:
        """The positions [0, n) every new token of the next step sees, whichever row it is on."""
        return self.length

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @property
    def rows(self) -> int:
        return self.keys[0].shape[0]

    def get_seq_length(self) -> int:
        return self.length

    def reserve(self, n: int) -> None:
        """Room for n more positions and one spare (grows by doubling, keeping what is held). The spare keeps a write
        from ever filling the buffer: a compiled step specialises on K and V being a part of it, not all of it, and
        would compile again midway (docs/models.md)."""
        need = self.length + n
        if need < self.capacity:
            return
        size = max(need + 1, 2 * self.capacity)
        # plain tensors even inside a forward: a compiled step (LeanLlama(compiled=True)) writes into the buffers,
        # which inductor cannot do to an inference tensor; writing into a plain one in inference mode is allowed
        with torch.inference_mode(False):
            for buf in (self.keys, self.values):
                for i, old in enumerate(buf):
                    new = old.new_zeros(*old.shape[:2], size, old.shape[3])
                    new[:, :, : self.length] = old[:, :, : self.length]
                    buf[i] = self._mark(new)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, kv_heads, T, head_dim] at [length, length + T) of `layer`; returns that layer's K and V
        up to them (views). `length` moves once every layer is written (advance)."""
        end = self.length + k.shape[2]
        self.keys[layer][:, :, self.length : end] = k
        self.values[layer][:, :, self.length : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, n: int) -> None:
        self.length += n

    def crop(self, n: int) -> None:
        self.length = cropped_length(self.length, n)

    def keep(self, start: int, rows: list[int]) -> None:
        """After a pass that began at `start`: keep its tokens `rows` (indices among the pass's, in order: a line of
        a token tree) right after the positions before it, and drop the rest. A prefix (0, 1, ..., n-1) moves the
        pointer only; a branch off the line copies its K and V behind the line (n positions a layer)."""
        n = len(rows)
        if rows != list(range(n)):
            src = torch.tensor(rows, device=self.keys[0].device) + start
            with torch.inference_mode():
                for buf in (self.keys, self.values):
                    for t in buf:
                        t[:, :, start : start + n] = t.index_select(2, src)
        self.length = start + n

    def batch_repeat_interleave(self, k: int) -> None:
        """Each row becomes k rows (a fork). Only the positions held are copied: past `length` a buffer is
        written before it is read, so the new buffers start empty there."""
        for buf in (self.keys, self.values):
            for i, t in enumerate(buf):
                new = self._new(t, t.shape[0] * k)
                new.view(t.shape[0], k, *t.shape[1:])[:, :, :, : self.length] = t[:, None, :, : self.length]
                buf[i] = new

    def batch_select_indices(self, idx: torch.Tensor) -> None:
        """Keep these rows, in this order. One row (a fork resolved) is a view of it: nothing is copied."""
        rows = idx.tolist()
        for buf in (self.keys, self.values):
            for i, t in enumerate(buf):
                if len(rows) == 1:
                    row = rows[0] % t.shape[0]
                    buf[i] = self._mark(t[row : row + 1])
                else:
                    new = self._new(t, len(rows))
                    new[:, :, : self.length] = t[idx.to(t.device), :, : self.length]
                    buf[i] = new


class BranchKV(KVBuffer):
    """The lean draft's cache: one physical row, whatever the number of branches. The k branches of a fork share the
    `shared` positions held when it forked; the token branch r feeds at depth s after that sits at shared + k·s + r
    (depth-major, so a step's k new tokens are written side by side). A branch step then runs as one row of k tokens
    with a tree mask (each branch sees the shared positions and its own tokens), and reads the shared K and V once for
    all k branches instead of once a branch. A fork copies nothing; resolving it moves the surviving branch's `depth`
    tokens behind the shared ones.
    Why: on this CPU a 3-row step of the 4-bit self-draft spent 4.5 ms in attention against 1.7 ms for one row,
    each row reading its own copy of the same 200 positions, and every fork first copied every layer's K and V k
    times (docs/models.md). With one branch it is KVBuffer with one row: the same positions, mask and bits.
    `length` counts physical positions; get_seq_length() is a branch's length (shared + depth), as the engine sees
    it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.branches, self.shared, self.depth = 1, 0, 0

    @property
    def rows(self) -> int:
        return self.branches

    def get_seq_length(self) -> int:
        return self.shared + self.depth

    def _settle(self, shared: int, depth: int, branches: int) -> None:
        if branches == 1:  # one branch: everything it holds is its own, as in a KVBuffer
            shared, depth = shared + depth, 0
        self.shared, self.depth, self.branches = shared, depth, branches
        self.length = shared + branches * depth

    def reserve(self, n: int) -> None:
        super().reserve(n * self.branches)

    def advance(self, n: int) -> None:
        self._settle(self.shared, self.depth + n, self.branches)

    def crop(self, n: int) -> None:
        keep = cropped_length(self.get_seq_length(), n)
        if keep >= self.shared:
            self._settle(self.shared, keep - self.shared, self.branches)
        else:  # back before the fork: the branches hold the same positions again (and are still k rows)
            self._settle(keep, 0, self.branches)

    def _regroup(self, parents: list[int]) -> None:
        """New branch i continues old branch parents[i]: their tokens after `shared` are gathered into the new
        depth-major layout (a copy of depth · len(parents) positions a layer)."""
        k, depth = len(parents), self.depth
        if depth:
            old = torch.tensor(
                [self.shared + self.branches * s + p for s in range(depth) for p in parents], device=self.keys[0].device
            )
            super().reserve(max(0, k - self.branches) * depth)
            with torch.inference_mode():  # no autograd bookkeeping for the copies
                for buf in (self.keys, self.values):
                    for t in buf:
                        t[:, :, self.shared : self.shared + k * depth] = t.index_select(2, old)
        self._settle(self.shared, depth, k)

    def batch_repeat_interleave(self, k: int) -> None:
        if self.branches == 1:  # a fork from one branch: it shares all it holds
            self._settle(self.get_seq_length(), 0, k)
        else:
            self._regroup([p for p in range(self.branches) for _ in range(k)])

    def batch_select_indices(self, idx: torch.Tensor) -> None:
        self._regroup([int(i) % self.branches for i in idx.tolist()])

    def select_row(self, row: int) -> None:
        """Keep branch `row` alone (cache.select_row)."""
        self._regroup([row % self.branches])

    def shared_length(self) -> int:
        return self.shared

    def keep(self, start: int, rows: list[int]) -> None:
        if self.branches > 1:
            raise ValueError("a forked draft cache keeps a branch by batch_select_indices")
        super().keep(start, rows)
        self._settle(self.length, 0, 1)

    def positions(self, t: int) -> torch.Tensor:
        """The rotary positions of a step's t new tokens a branch, in the order they are stored: [t · k]."""
        return (self.get_seq_length() + torch.arange(t, device=self.keys[0].device)).repeat_interleave(self.branches)

    def mask(self, t: int, rep: int) -> torch.Tensor | None:
        """bool [rep · t · k, length + t · k]: which stored positions each new token sees (every shared one, then its
        own branch's up to itself); the rows repeat for the rep query heads stacked on each KV head. None for one new
        token on one branch: it sees everything."""
        k, device = self.branches, self.keys[0].device
        if t * k == 1:
            return None
        own = torch.arange(self.length + t * k, device=device) - self.shared  # past the shared: depth·k + branch
        new = torch.arange(t * k, device=device)  # the new tokens, depth-major
        sees = (own[None, :] < 0) | (
            (own[None, :] % k == new[:, None] % k) & (own[None, :] // k <= self.depth + new[:, None] // k)
        )
        return sees.repeat(rep, 1)


class GenericDecoder:
    """A Llama decoder (its first `layers` layers, then the final norm) over a static KV cache (KVBuffer, BranchKV),
    on any device: the model's own weights through F.linear in its own dtype, and its norms, activation and rotary
    arithmetic as transformers runs them. __call__(input_ids [B, T], cache, hidden_states) -> (the final-norm states
    [B, T, H], the per-layer states as transformers returns them, or None), appending T positions to the cache.

    The step (_step) has static shapes, gpt-fast's way, so torch.compile(mode="reduce-overhead") captures it as a CUDA
    graph: the cache's buffers keep their capacity and address (KVBuffer(static=True)); the new K and V are written
    in place at `slots`, a tensor (index_copy_); attention reads the whole buffer through a mask computed inside the
    step from the slots and the shared length (a tensor): a new token sees every shared position and its own row's or
    branch's positions up to its own slot, never a stale one past them, so rolling back stays a pointer. Everything
    the step needs from the host (the slots, the positions' rotary rows, the shared length) is made before it by
    kernel launches (arange, full, index) that read nothing back, and inside it nothing is read back either (no
    .item(), .tolist() or data-dependent shape): tests/test_gpu_models.py traces it whole (fullgraph) on the CPU.

    Rows: a KVBuffer's B rows are B sequences of T new tokens each; a BranchKV's k branches run as one row of T·k
    tokens (depth-major), its tree mask from the same formula with k branches. Against transformers' forward the
    states differ only by how attention sums over the masked (zero-weight) positions: float rounding.

    compile(mode): torch.compile of the step (fullgraph, shapes as dynamo sees them: a new number of tokens or
    branches, or a grown cache, records another graph); used for steps of at most GRAPH_TOKENS tokens in all and no
    per-layer states, the rest eager. Where compiling or a compiled step fails (not out of memory), the steps stay
    eager and compile_why says why. A compiled step runs on the thread that compiled it only (`owner`): CUDA graph
    trees keep their state per thread, and a graph recorded on one thread raises on another; elsewhere the step runs
    eager (the engine calls every step of a model on its one worker thread, runtime.model_worker)."""

    def __init__(self, model, layers: int | None = None):
        c = model.config
        self.heads = heads_of(c)
        self.context = int(getattr(c, "max_position_embeddings", GENERIC_CAPACITY))
        inner = model.model
        self.embed = model.get_input_embeddings()
        self.rotary = inner.rotary_emb
        self.norm = inner.norm
        self.layers = list(inner.layers[: layers if layers is not None else c.num_hidden_layers])
        self.weights = [self._weights(block) for block in self.layers]
        self.scaling = self.layers[0].self_attn.scaling
        self._cos = self._sin = None
        self._graph, self.mode, self.compile_why, self.owner = None, None, "", None
        self._spare = None  # (keys, values) of a cache that is gone, for the next new_cache
        self._spare_lock = threading.RLock()  # a cache may be collected on any thread (or inside new_cache, by a
        # collection there: reentrant): one pair of buffers is never handed out twice

    @staticmethod
    def _weights(block) -> LayerWeights:
        """The layer's own Parameters through F.linear (no copies; on a GPU the model's memory is the budget): q, k and
        v as three products concatenated, which torch.compile fuses."""
        a, m = block.self_attn, block.mlp
        q, k, v, o = a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight
        gate, up, down = m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight
        return LayerWeights(
            block.input_layernorm,
            lambda h: torch.cat([F.linear(h, q), F.linear(h, k), F.linear(h, v)], -1),
            lambda h: F.linear(h, o),
            block.post_attention_layernorm,
            lambda h: torch.cat([F.linear(h, gate), F.linear(h, up)], -1),
            lambda h: F.linear(h, down),
            m.act_fn,
        )

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    # -- caches
    def new_cache(self, capacity: int | None = None, kind: type | None = None):
        """A static cache (KVBuffer(static=True), or `kind`: BranchKV) of `capacity` positions (default: the model's
        context and one spare, at most GENERIC_CAPACITY). It takes the buffers of the last cache made here once that
        one is gone (same addresses: a CUDA graph recorded on them replays), else allocates."""
        kind = kind or KVBuffer
        capacity = capacity or min(self.context + 1, GENERIC_CAPACITY)
        with self._spare_lock:
            spare, self._spare = self._spare, None
        if spare is not None and (spare[0][0].shape[0] != 1 or spare[0][0].shape[2] != capacity):
            spare = None
        cache = kind(
            len(self.layers),
            self.heads.kv,
            self.heads.dim,
            self.dtype,
            self.device,
            capacity,
            static=True,
            buffers=spare,
        )
        weakref.finalize(cache, self._release, cache.keys, cache.values)  # the lists: what the cache holds at its end
        return cache

    def _release(self, keys: list, values: list) -> None:
        with self._spare_lock:
            self._spare = (keys, values)

    def rope_table(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [end, D] (at least), float32: the rotary module's own from its float32 inv_freq, regrown by
        doubling (a step casts its rows to the states' dtype, as the module's forward does)."""
        if self._cos is None or self._cos.shape[0] < end:
            n = max(end, 2 * (0 if self._cos is None else self._cos.shape[0]), CAPACITY)
            pos = torch.arange(n, device=self.device)[None]
            cos, sin = self.rotary(torch.zeros(1, device=self.device), position_ids=pos)
            self._cos, self._sin = cos[0], sin[0]
        return self._cos, self._sin

    # -- compiling
    def compile(self, mode: str | None = None, backend: str = "inductor") -> None:
        """Compile the step (lazily: each shape compiles at its first use), for this thread (owner). mode:
        compile_mode(device) unless given ("reduce-overhead": CUDA graphs); backend: inductor, or another of
        torch.compile's (a test's "aot_eager")."""
        self.mode = mode or compile_mode(self.device)
        options = {"mode": self.mode} if backend == "inductor" else {}
        self._graph = torch.compile(self._own_step(), fullgraph=True, backend=backend, **options)
        self.compile_why, self.owner = "", threading.get_ident()

    def warm_up(self, cache) -> None:
        """Three one-token steps on `cache`, on this thread: CUDA graph trees run a new graph eagerly once, then
        record it, then replay it, so a run's first step pays none of it."""
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            for _ in range(3):
                self(ids, cache)

    def _own_step(self):
        """_step bound to this decoder through a code object of its own. Dynamo keeps its compiled graphs, and its
        limit of 8 recompiles, per code object: on one shared _step the target's and each draft's graphs (their
        layer counts differ, so their guards do) took each other's places, and past 8 the step failed for good
        (FailOnRecompileLimitHit)."""
        step = GenericDecoder._step
        own = types.FunctionType(step.__code__.replace(), step.__globals__, step.__name__, step.__defaults__)
        return types.MethodType(own, self)

    @property
    def cuda_graphs(self) -> bool:
        return self._graph is not None and self.mode == "reduce-overhead" and self.device.type == "cuda"

    # -- a forward
    def __call__(
        self, input_ids: torch.Tensor, cache: KVBuffer, hidden_states: bool = False, tree: TokenTree | None = None
    ):
        b, t = input_ids.shape
        if cache.rows != b:
            raise ValueError(f"the cache holds {cache.rows} rows, fed {b}")
        branches = getattr(cache, "branches", 1)
        ids = input_ids.transpose(0, 1).reshape(1, t * b) if branches > 1 else input_ids  # [R, n], depth-major
        rows, n = ids.shape
        tree = None if tree is None or tree.is_line else tree
        start = cache.length
        positions = cache.positions(t) if tree is None else tree.positions(start, self.device)  # [n]: rotary
        cache.reserve(t)
        slots = start + torch.arange(n, device=self.device)  # where the n new tokens are stored
        shared = torch.full((1,), cache.shared_length(), dtype=torch.long, device=self.device)
        cos, sin = self.rope_table(cache.get_seq_length() + t)
        sees = None
        if tree is not None:  # the tree's own mask over the whole buffer (made on the host: a tree pass is rare)
            sees = torch.zeros(n, cache.capacity, dtype=torch.bool)
            sees[:, : start + n] = tree.sees(start)
            sees = sees.to(self.device, non_blocking=True)
        args = (
            ids,
            cache.keys,
            cache.values,
            slots,
            shared,
            cos[positions].to(self.dtype),
            sin[positions].to(self.dtype),
        )
        if self._graph is not None and not hidden_states and rows * n <= GRAPH_TOKENS and self._mine():
            x, hidden = self._compiled(args, branches, sees)
        else:
            x, hidden = self._step(*args, branches, sees, hidden_states)
        cache.advance(t)
        if branches > 1:
            x = x.view(t, b, -1).transpose(0, 1)  # [B, T, H]
        return x, hidden

    def _mine(self) -> bool:
        """Whether this thread compiled the step (its graphs are this thread's)."""
        return threading.get_ident() == self.owner

    def _compiled(self, args: tuple, branches: int, sees: torch.Tensor | None):
        try:
            if self.cuda_graphs:  # a new step: the outputs of the last replay may be overwritten (they were cloned)
                torch.compiler.cudagraph_mark_step_begin()
            x, _ = self._graph(*args, branches, sees, False)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever dynamo or inductor raise, the eager step serves
            self._graph, self.compile_why = None, f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"[:300]
            return self._step(*args, branches, sees, False)
        return (x.clone() if self.cuda_graphs else x), None  # a CUDA graph's output lives until its next replay

    def _step(
        self,
        ids: torch.Tensor,
        keys: list,
        values: list,
        slots: torch.Tensor,
        shared: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        branches: int,
        sees: torch.Tensor | None = None,
        hidden_states: bool = False,
    ):
        """ids [R, n]; keys, values: the cache's buffers [R, Hkv, C, D], written at `slots` [n] in place; shared [1]:
        the positions every new token sees; cos, sin [n, D] at the new tokens' rotary positions; branches: k, the new
        tokens' branches in turn (1: each row one sequence); sees: bool [n, C], a token tree's mask (None: made here)
        -> (final-norm states [R, n, H], per-layer states)."""
        n, capacity = ids.shape[1], keys[0].shape[2]
        if sees is None:  # slot s is seen by new token j where s is shared, or on j's branch at or before j's own slot
            s = torch.arange(capacity, device=ids.device)
            j = torch.arange(n, device=ids.device)
            own = s - shared  # [C]: < 0 for the shared positions
            on_branch = (own % branches)[None, :] == (j % branches)[:, None]
            sees = (own < 0)[None, :] | (on_branch & (s[None, :] <= slots[:, None]))  # [n, C]
        attend = grouped_attention(sees.repeat(self.heads.q // self.heads.kv, 1), self.scaling)
        x = self.embed(ids)  # [R, n, H]
        hidden = [x] if hidden_states else None
        for i, w in enumerate(self.weights):

            def store(k, v, i=i):  # in place at the slots: static addresses for a CUDA graph
                keys[i].index_copy_(2, slots, k)
                values[i].index_copy_(2, slots, v)
                return keys[i], values[i]

            x = decoder_layer(x, w, self.heads, cos, sin, store, attend)
            if hidden is not None:
                hidden.append(x)
        x = self.norm(x)
        if hidden is not None:
            hidden[-1] = x  # transformers ties the last hidden state to the final-norm one
        return x, (tuple(hidden) if hidden is not None else None)


class LeanLlama(torch.nn.Module):
    """A Llama model's decoder (not its head) for drafting: forward(input_ids [B, T], cache: BranchKV) -> the
    final-norm hidden states [B, T, H], appending T positions to the cache. `kind` is the draft's matmul kind
    (models.draft_matmul_kind). Holds the model's tensors, not copies, besides the matmuls' own layouts.
    compiled: one-token steps on one branch run through torch.compile, compiled here (compile_step(): a warm-up step
    on a scratch cache: ~40 s for the 30-layer self-draft on 2 cores the first time, less once inductor's cache on
    disk holds its kernels); where compiling fails (or a bfloat16 draft, whose packed matmuls inductor cannot lower)
    they stay eager and compile_why says why."""

    def __init__(self, model, kind: str = "float32", compiled: bool = False, kernels: str | None = None):
        super().__init__()
        why = fits(model)
        if why:
            raise ValueError(f"the lean decode path does not fit this model: {why}")
        # kernels: "cpu" (lm_head's matmuls of `kind`, the cache cut to what it holds) or "generic" (GenericDecoder,
        # any device; the weights as loaded); default_kernels(the model's device) unless given
        self.kernels = kernels or default_kernels(next(model.parameters()).device)
        if self.kernels not in ("cpu", "generic"):
            raise ValueError(f"unknown kernels {self.kernels!r}; cpu or generic")
        if self.kernels == "generic" and kind != "float32":
            raise ValueError(f"the generic kernels read the weights as loaded, not through {kind} matmuls")
        self._generic = GenericDecoder(model) if self.kernels == "generic" else None
        c = model.config
        self.heads = heads_of(c)
        self.hidden, self.eps = c.hidden_size, c.rms_norm_eps
        self.embed = model.get_input_embeddings()
        self.rotary = model.model.rotary_emb  # its table: rope scaling as the model computes it
        self.norm = model.model.norm.weight
        self.layers = [] if self._generic else [self._layer(block, kind) for block in model.model.layers]
        self._cos = self._sin = None
        self.kind, self._step, self.compile_why, self.compile_s = kind, None, "", None
        if compiled and self._generic is None:  # the generic steps compile on the thread that runs them (compile_here)
            self.compile_step()

    @property
    def compiles_here(self) -> bool:
        """Whether the steps compile on the thread that will call them (the generic kernels: CUDA graph trees keep
        their state per thread), not at load: models.LM.compile_here, on the model's worker."""
        return self._generic is not None

    def compile_step(self, backend: str = "inductor") -> None:
        """Compile the one-token, one-branch step and run it once on a scratch cache (shapes dynamic: the cache's
        length changes every step and must not recompile it); only then do forwards take it. A failure (no C++
        compiler, an inductor error) leaves the step eager; a bfloat16 draft is refused at once: inductor cannot lower
        oneDNN's packed weights (lm_head.Bf16Matmul). compile_s: how long it took.
        Generic kernels: the steps of at most GRAPH_TOKENS tokens, one-token and k-row alike, in compile_mode(device)
        ("reduce-overhead" on CUDA: CUDA graphs), warmed up here on a one-token step (its graph then replays on the
        next cache, which takes the scratch cache's buffers); `backend` another of torch.compile's (tests)."""
        if self._generic is not None:
            self._compile_generic(backend)
            return
        if self.kind == "bfloat16":
            self.compile_why = (
                "a bfloat16 draft's oneDNN-packed matmuls do not compile; use --draft-matmul int4 or float32"
            )
            return
        start, threads = time.perf_counter(), torch.get_num_threads()
        torch.set_num_threads(STEP_THREADS)
        try:
            step = torch.compile(self._decode, dynamic=True)
            cache = self.new_cache()
            with torch.inference_mode():
                self._forward(torch.zeros(1, 2, dtype=torch.long, device=self.norm.device), cache)
                self._forward(torch.zeros(1, 1, dtype=torch.long, device=self.norm.device), cache, step)
            self._step = step
        except Exception as exc:  # noqa: BLE001 - whatever inductor raises, the eager step still serves
            self.compile_why = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"[:300]
        finally:
            torch.set_num_threads(threads)
        self.compile_s = time.perf_counter() - start

    def _compile_generic(self, backend: str) -> None:
        start, generic = time.perf_counter(), self._generic
        try:
            generic.compile(backend=backend)
            generic.warm_up(self.new_cache())
            self.compile_why = generic.compile_why
            self._step = generic._graph
        except Exception as exc:  # noqa: BLE001 - whatever inductor raises, the eager step still serves
            generic._graph = None
            self.compile_why = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"[:300]
        self.compile_s = time.perf_counter() - start

    @property
    def compile_state(self) -> str:
        """ "compiled", "eager" (compiling failed: compile_why says why) or "off" (not tried)."""
        if self._generic is not None:
            self._step = self._generic._graph  # a compiled step that failed later leaves it eager
            self.compile_why = self.compile_why or self._generic.compile_why
        return "compiled" if self._step is not None else "eager" if self.compile_why else "off"

    def _layer(self, block, kind: str) -> LayerWeights:
        a, m = block.self_attn, block.mlp
        qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach()  # [(Hq + 2 Hkv) D, H]
        gate_up = torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach()  # [2 I, H]

        def mm(w):  # a bfloat16 or 4-bit matmul keeps no float32 copy: the fused ones would double the weights
            return draft_matmul(kind, w, keep_weight=False)

        def norm(weight):  # F.rms_norm: one fused op where transformers' module runs five (a draft's bits are its own)
            return lambda x: F.rms_norm(x, (self.hidden,), weight, self.eps)

        return LayerWeights(
            norm(block.input_layernorm.weight),
            mm(qkv),
            mm(a.o_proj.weight),
            norm(block.post_attention_layernorm.weight),
            mm(gate_up),
            mm(m.down_proj.weight),
        )

    def new_cache(self, capacity: int | None = None) -> BranchKV:
        if self._generic is not None:  # static: the context's positions from the start (GenericDecoder.new_cache)
            return self._generic.new_cache(capacity, BranchKV)
        return BranchKV(
            len(self.layers), self.heads.kv, self.heads.dim, self.norm.dtype, self.norm.device, capacity or CAPACITY
        )

    def _rope_table(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [end, D] (at least), float32 whatever the weights' dtype: computed once by the model's rotary
        module from its float32 inv_freq, regrown by doubling. A step casts the rows it reads to the states' dtype,
        as the rotary module's forward casts its float32 cos and sin (the same values, so the same bits)."""
        if self._cos is None or self._cos.shape[0] < end:
            n = max(end, 2 * (0 if self._cos is None else self._cos.shape[0]), CAPACITY)
            pos = torch.arange(n, device=self.norm.device)[None]
            cos, sin = self.rotary(torch.zeros(1, device=self.norm.device), position_ids=pos)
            self._cos, self._sin = cos[0], sin[0]
        return self._cos, self._sin

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: BranchKV) -> torch.Tensor:
        if self._generic is not None:
            return self._generic(input_ids, cache)[0]
        if self._step is None or input_ids.numel() != 1 or cache.rows != 1:
            return self._forward(input_ids, cache)
        # the compiled graph guards on the torch thread count and on the ids' dispatch keys and strides: it runs on
        # the threads it was compiled for, and the ids are cloned here into a fresh inference tensor, as at the
        # warm-up; else each would compile the graph again in the middle of a run (27 s, 4 s, docs/models.md)
        threads = torch.get_num_threads()
        if threads != STEP_THREADS:
            torch.set_num_threads(STEP_THREADS)
        try:
            return self._forward(input_ids.clone(memory_format=torch.contiguous_format), cache, self._step)
        finally:
            if threads != STEP_THREADS:
                torch.set_num_threads(threads)

    def _forward(self, input_ids: torch.Tensor, cache: BranchKV, decode=None) -> torch.Tensor:
        """The step's bookkeeping (positions, room in the cache, the rotary rows, the mask), then its decoder layers
        (`decode`: the compiled _decode, else _decode itself). The rotary table stays out of the compiled graph: its
        length equalled the cache buffers' at the warm-up, so the graph assumed they stay equal (duck sizing) and a
        new cache after a regrown table compiled it again (27 s, docs/models.md)."""
        b, t = input_ids.shape  # b: the cache's branches
        if cache.rows != b:
            raise ValueError(f"the cache holds {cache.rows} rows, fed {b}")
        positions = cache.positions(t)  # [n]
        cache.reserve(t)
        cos, sin = self._rope_table(cache.get_seq_length() + t)  # the last new token's position + 1
        dtype = self.norm.dtype
        out = (decode or self._decode)(
            input_ids,
            cache,
            cos[positions].to(dtype),
            sin[positions].to(dtype),
            cache.mask(t, self.heads.q // self.heads.kv),
        )
        cache.advance(t)
        return out

    def _decode(
        self, input_ids: torch.Tensor, cache: BranchKV, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """input_ids [b, t]; cos, sin [n, D] at the new tokens' positions; mask (BranchKV.mask) -> [b, t, H]."""
        b, t = input_ids.shape
        n = t * b  # the step runs as one row of n tokens, depth-major (BranchKV)
        x = self.embed(input_ids).transpose(0, 1).reshape(1, n, self.hidden)  # [1, n, H]
        attend = grouped_attention(mask)
        for i, w in enumerate(self.layers):

            def store(k, v, i=i):
                return cache.write(i, k, v)  # [1, Hkv, length + n, D]

            x = decoder_layer(x, w, self.heads, cos, sin, store, attend)
        return F.rms_norm(x, (self.hidden,), self.norm, self.eps).view(t, b, self.hidden).transpose(0, 1)  # [b, t, H]


def compile_report(name: str, why: str, done: str) -> str:
    """How a draft's compile ended, for the console: `why` it stays eager, else `done`."""
    return f"the draft {name!r}: " + (f"steps stay eager, not compiled: {why}" if why else done)

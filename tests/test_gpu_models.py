"""Issue 41, part 3, the models' defects that reading the CUDA path showed, checked on the CPU: rotary tables that stay
float32 whatever a draft's dtype, a prefill whose LM head runs on its last row only, devices compared by their
canonical names, and the static-cache decode paths (lean, static_forward) in a device-agnostic variant whose steps
have static shapes and no host sync (what torch.compile(mode="reduce-overhead") captures as CUDA graphs on a GPU)."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from engine.config import GenerationConfig
from engine.drafts.distilled import draft_from_target, load_draft_dir, place, save_draft
from engine.drafts.head import FeatureHead, load_head_dir, save_head
from engine.models.lean import LeanLlama

from .test_lean import tiny_llama


# ---------------------------------------------------------------- 1. rotary tables stay float32
def fp32_inv_freq(config) -> torch.Tensor:
    """The table transformers computes for `config`, in float32."""
    return LlamaRotaryEmbedding(config).inv_freq


def rotary_buffers(module) -> list:
    """(owner, name) of every rotary table buffer (transformers' inv_freq, original_inv_freq) in `module`."""
    return [(m, name) for m in module.modules() for name, _ in m.named_buffers(recurse=False) if "inv_freq" in name]


def cast_model(module, device=None, dtype=None):
    from engine.models.devices import cast_model

    return cast_model(module, device, dtype)


def assert_rotary_fp32(module, config) -> None:
    found = rotary_buffers(module)
    assert found, "no rotary table found"
    want = fp32_inv_freq(config)
    for owner, name in found:
        table = getattr(owner, name)
        assert table.dtype == torch.float32, (name, table.dtype)
        assert torch.equal(table, want), name


def test_a_draft_or_head_cast_to_bfloat16_keeps_float32_rotary_tables(tmp_path):
    """A distilled draft (place, load_draft_dir), a feature head (from_target of a bfloat16 target, load_head_dir) and
    any module through cast_model: their weights in bfloat16, their inv_freq float32 with the float32 values (a .to()
    rounded them to bfloat16: 0.0094 became 0.0093994140625 and so on). The lean path's precomputed cos and sin are
    float32 too, equal to the rotary module's own float32 output."""
    target = tiny_llama(seed=1)
    config = target.config
    draft = place(draft_from_target(target, 2), target, "cpu", torch.bfloat16)
    assert next(draft.parameters()).dtype == torch.bfloat16
    assert_rotary_fp32(draft, config)

    save_draft(draft_from_target(target, 2), tmp_path / "draft", None, {})
    loaded, _ = load_draft_dir(tmp_path / "draft", target, torch.bfloat16, torch.device("cpu"))
    assert next(loaded.parameters()).dtype == torch.bfloat16
    assert_rotary_fp32(loaded, config)

    target.save_pretrained(tmp_path / "target")
    bf16_target = AutoModelForCausalLM.from_pretrained(tmp_path / "target", dtype=torch.bfloat16)
    assert_rotary_fp32(bf16_target, config)  # transformers keeps them float32
    head = FeatureHead.from_target(bf16_target, 1)
    assert next(head.parameters()).dtype == torch.bfloat16
    assert_rotary_fp32(head, config)
    save_head(
        FeatureHead.from_target(target, 1),
        tmp_path / "head",
        torch.arange(10),
        {"hidden_size": config.hidden_size, "vocab_size": config.vocab_size, "target_layers": config.num_hidden_layers},
    )
    head, _ = load_head_dir(tmp_path / "head", target, torch.bfloat16, "cpu")
    assert next(head.parameters()).dtype == torch.bfloat16
    assert_rotary_fp32(head, config)

    lean = LeanLlama(draft, "float32")
    cos, sin = lean._rope_table(40)
    rotary = LlamaRotaryEmbedding(config)
    want_cos, want_sin = rotary(torch.zeros(1), torch.arange(cos.shape[0])[None])
    assert cos.dtype == sin.dtype == torch.float32
    assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])

    # the helper itself: a cast keeps them; one made elsewhere, without it, is undone from the module's config
    assert_rotary_fp32(cast_model(tiny_llama(seed=1), dtype=torch.bfloat16), config)
    rounded = tiny_llama(seed=1).to(torch.bfloat16)
    assert rounded.model.rotary_emb.inv_freq.dtype == torch.bfloat16
    assert_rotary_fp32(cast_model(rounded, dtype=torch.bfloat16), config)
    generic = LeanLlama(cast_model(tiny_llama(seed=1), dtype=torch.bfloat16), kernels="generic")._generic
    cos, sin = generic.rope_table(40)  # the generic kernels' table: float32 too
    assert cos.dtype == torch.float32 and torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])


# ---------------------------------------------------------------- 3. devices compared by their canonical names
def fake_gpus(monkeypatch, count: int = 2, current: int = 0) -> None:
    """torch.cuda as on a machine with `count` GPUs, `current` the current one (no CUDA call is made)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)


def test_devices_are_canonical_and_a_draft_on_the_targets_gpu_shares_its_embeddings(monkeypatch):
    """pick_device names the GPU as its tensors (and the workers) do, `cuda:<current>`; and `place`, given `cuda` for
    a target whose tensors report `cuda:0`, shares the target's embeddings and head instead of copying them (the move
    itself is stubbed: no CUDA tensor is made). Another GPU, or another dtype, still gets its own copies."""
    from transformers import LlamaForCausalLM

    from engine.models.loading import pick_device

    fake_gpus(monkeypatch, count=2, current=1)
    assert pick_device("cuda") == torch.device("cuda", 1) == pick_device(None)
    assert pick_device("cuda:0") == torch.device("cuda", 0) and pick_device("cpu") == torch.device("cpu")

    fake_gpus(monkeypatch, count=1, current=0)
    target, moved = tiny_llama(seed=3), []
    monkeypatch.setattr(LlamaForCausalLM, "device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(LlamaForCausalLM, "to", lambda self, *a, **k: moved.append(k or a) or self)  # no CUDA tensor
    draft = place(draft_from_target(target, 1), target, "cuda", torch.float32)
    assert draft.model.embed_tokens is target.model.embed_tokens and draft.lm_head is target.lm_head
    assert moved and all(m.get("device") == "cuda" for m in moved if isinstance(m, dict))

    from engine.models.devices import canonical_device, same_device

    fake_gpus(monkeypatch, count=2, current=1)
    assert canonical_device("cuda") == torch.device("cuda", 1) and canonical_device(None) == torch.device("cpu")
    assert same_device("cuda", "cuda:1") and same_device(torch.device("cuda"), torch.device("cuda", 1))
    assert not same_device("cuda", "cuda:0") and not same_device("cuda:0", "cpu") and same_device(None, "cpu")
    fake_gpus(monkeypatch, count=2, current=0)
    other = place(draft_from_target(target, 1), target, "cuda:1", torch.float32)
    assert other.model.embed_tokens is not target.model.embed_tokens and other.lm_head is not target.lm_head
    half = place(draft_from_target(target, 1), target, "cuda", torch.bfloat16)
    assert half.model.embed_tokens is not target.model.embed_tokens


# ---------------------------------------------------------------- 2. a prefill's LM head on its last row only
class RowCounter:
    """A head that counts the rows it is fed and computes them with the real one."""

    def __init__(self, head):
        self.head, self.rows = head, []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.append(x.numel() // x.shape[-1])
        return self.head(x)


@pytest.mark.parametrize("path", ["transformers", "static", "lean", "subset", "unplain"])
def test_last_only_runs_the_head_on_one_row(path):
    """LM.forward(last_only=True) on each of its paths: logits [1, 1, V] equal to the last row of a full pass
    (float rounding: one row may go through another kernel than T rows), the head fed 1 row, the features every
    position's; the default still gives every row. `unplain`: a model whose logits are more than its head (a head with
    a bias), through transformers' logits_to_keep, its lm_head counted by a forward hook."""
    from engine.models.loading import LM

    model = tiny_llama(seed=4)
    ids = torch.randint(0, 101, (1, 20), generator=torch.Generator().manual_seed(4))
    kwargs = {"static": dict(static=True), "lean": dict(lean=True), "subset": dict(head_ids=torch.arange(0, 101, 2))}
    if path == "unplain":
        model.lm_head.bias = torch.nn.Parameter(torch.randn(101) * 0.1)
    lm = LM("tiny", model, None, 101, **kwargs.get(path, {}))
    assert (lm._head is None) == (path == "unplain") and lm.static == (path == "static")
    counted = []
    if path == "unplain":
        model.lm_head.register_forward_hook(lambda m, args, out: counted.append(args[0].shape[1]))
    else:
        lm._head = RowCounter(lm._head)
        counted = lm._head.rows
    full = lm.forward(ids, lm.new_cache(), features=True)
    assert full.logits.shape == (1, 20, 101) and counted == [20]
    last = lm.forward(ids, lm.new_cache(), features=True, last_only=True)
    assert last.logits.shape == (1, 1, 101) and counted == [20, 1]
    torch.testing.assert_close(last.logits, full.logits[:, -1:], rtol=1e-5, atol=1e-5)
    if path != "unplain":
        assert torch.equal(last.features, full.features) and last.features.shape == (1, 20, 96)
    plain = lm.last_row.forward(ids, lm.new_cache())  # the view a prefill goes through
    assert plain.shape == (1, 1, 101) and counted[-1] == 1 and lm.last_row.vocab_size == 101


def test_a_prefill_feeds_each_models_head_one_row(tmp_path):
    """Through the engine (decoding.prefill): the target's head runs on 1 row for a 12-token prompt, then on the rows
    each step feeds, and so does the draft's (its prefill's logits are never read); the output is AR's before and
    after."""
    from engine.config import GenerationConfig
    from engine.engine import Engine
    from engine.models.loading import load_pair

    from .conftest import make_tiny_model

    target = make_tiny_model(tmp_path / "target", seed=1)
    draft = make_tiny_model(tmp_path / "draft", seed=1, perturb=0.5, perturb_seed=2)
    engine = Engine(load_pair(str(target), str(draft), device="cpu", draft_worker="thread"))
    try:
        prompt = [2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4, 5]
        want = engine.run(prompt, GenerationConfig(method="ar", max_new_tokens=6)).token_ids
        counter = engine.pair.target._head = RowCounter(engine.pair.target._head)
        assert engine.run(prompt, GenerationConfig(method="ar", max_new_tokens=6)).token_ids == want
        assert counter.rows == [1] * 6  # the prefill's row, then five 1-token steps
        counter.rows.clear()
        drafted = engine.pair.draft._head = RowCounter(engine.pair.draft._head)
        assert engine.run(prompt, GenerationConfig(method="sd", max_new_tokens=6, gamma=3)).token_ids == want
        assert counter.rows[0] == 1 and all(r <= 4 for r in counter.rows[1:])  # verify passes: gamma + 1 rows
        assert len(drafted.rows) > 1 and drafted.rows == [1] * len(drafted.rows)  # the prefill's, then 1-token steps
    finally:
        engine.close()


# ---------------------------------------------------------------- 4. the static-cache paths, device-agnostic
def assert_close_passes(static, plain, ids: torch.Tensor, capacity: int, check) -> None:
    """Feed both LMs the engine's passes (a prefill, 1-token steps, a 4-token verify pass), roll both back by 3 and
    verify again: logits, features and (every other pass) the hidden states pass check(mine, transformers')."""
    a, b = static._static.new_cache(capacity), plain.new_cache()
    n = ids.shape[1]
    cuts = [0, n // 2, n // 2 + 1, n // 2 + 5, n // 2 + 6]
    for i, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
        hidden = i % 2 == 0
        x, y = (
            lm.forward(ids[:, lo:hi], c, hidden_states=hidden, features=True) for lm, c in ((static, a), (plain, b))
        )
        check(x.logits, y.logits)
        check(x.features, y.features)
        if hidden:
            assert len(x.hidden_states) == len(y.hidden_states)
            for p, q in zip(x.hidden_states, y.hidden_states):
                check(p, q)
    for cache in (a, b):
        cache.crop(-3)
    rest = ids[:, cuts[-1] - 3 :]
    check(static.forward(rest, a), plain.forward(rest, b))
    assert a.get_seq_length() == b.get_seq_length() == n and a.capacity > capacity  # it grew


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generic_static_target_follows_transformers(dtype):
    """The target's static path through the generic kernels (what it runs on a GPU; forced here), through LM: the
    logits, features and hidden states of a prefill, steps, a verify pass, a rollback and the pass after it, against
    transformers' forward of the same model: float32 within 1e-4 (only attention's sums over the masked positions
    differ), bfloat16 within 2 % of the largest value. Its probe (StaticLlama.agrees, by closeness) passes in both;
    the CPU's kernels stay bit-identical (tests/test_static_forward.py)."""
    from engine.models.lean import KVBuffer
    from engine.models.loading import LM

    model = cast_model(tiny_llama(seed=6), dtype=dtype)
    static, plain = LM("tiny", model, None, 101, static=True, kernels="generic"), LM("tiny", model, None, 101)
    assert static.static and static._static.kernels == "generic" and static._static.generic is not None
    assert static._static is not LM("tiny", model, None, 101, static=True)._static  # one per kernels
    cache = static.new_cache()
    assert isinstance(cache, KVBuffer) and cache.static and cache.capacity == 513  # the context, and a spare
    ids = torch.randint(0, 101, (1, 30), generator=torch.Generator().manual_seed(7))

    def check(mine, theirs):
        if dtype == torch.float32:
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
        else:  # bfloat16: within 2 % of the largest value (one bfloat16 step at it is 0.4-0.8 %)
            assert (mine.float() - theirs.float()).abs().max() <= 0.02 * theirs.float().abs().max()

    assert_close_passes(static, plain, ids, 8, check)


def test_generic_kernels_decode_exactly_through_the_engine(tiny_dirs):
    """A target on the generic static path and a draft on the generic lean path (forced on the CPU): greedy SD, PEARL
    and SpecBranch (forks: k-row branch steps) give AR's tokens."""
    from engine.models.loading import LM, ModelPair, load_model

    from .test_lm_head import assert_speculation_equals_ar

    cpu = torch.device("cpu")
    target, tok = load_model(str(tiny_dirs["target"]), cpu, torch.float32)
    draft, _ = load_model(str(tiny_dirs["draft"]), cpu, torch.float32)
    vocab = target.config.vocab_size
    pair = ModelPair(
        LM("t", target, tok, vocab, static=True, kernels="generic"),
        LM("d", draft, tok, vocab, lean=True, kernels="generic"),
    )
    assert pair.target._static.kernels == pair.draft._lean.kernels == "generic"
    assert_speculation_equals_ar(pair)


def test_the_cpu_keeps_its_kernels_and_another_device_takes_the_generic_ones():
    """By device: the CPU's kernels on the CPU (the fused, oneDNN-routed matmuls of today, no compile of the target),
    the generic ones elsewhere (a model on the meta device stands for a GPU: nothing is computed), and the compile mode
    CUDA graphs on CUDA. The generic kernels read the weights as loaded: a 4-bit or bfloat16 draft stays on the
    CPU's."""
    from engine.kernels.lm_head import HeadMatmul
    from engine.models.lean import compile_mode, default_kernels
    from engine.models.lean import fits as lean_fits
    from engine.models.loading import LM, lean_draft, static_target
    from engine.models.static_forward import StaticLlama, fits

    assert default_kernels("cpu") == "cpu" and default_kernels("cuda") == default_kernels("cuda:1") == "generic"
    assert compile_mode("cuda:0") == "reduce-overhead" and compile_mode("cpu") == "default"
    target = LM("t", tiny_llama(seed=6), None, 101, static=True)
    draft = LM("d", tiny_llama(seed=7), None, 101, lean=True)
    assert target._static.kernels == "cpu" and target._static.generic is None
    assert all(isinstance(w.qkv, HeadMatmul) and isinstance(w.gate_up, HeadMatmul) for w in target._static.weights)
    assert draft._lean.kernels == "cpu" and draft._lean._generic is None
    assert isinstance(draft._lean.layers[0].qkv, HeadMatmul) and draft._lean.new_cache().capacity == 256
    with pytest.raises(ValueError, match="read the weights as loaded, not through int4"):
        LeanLlama(tiny_llama(), "int4", kernels="generic")

    meta = tiny_llama(seed=8).to("meta")
    meta.config._attn_implementation = "eager"  # the CPU's kernels need sdpa; the generic ones compute attention
    assert fits(meta) is None and lean_fits(meta) is None and static_target(meta, "static")
    assert lean_draft(meta, tiny_llama(), "lean")  # no longer on the CPU only
    assert fits(meta, "cpu") == "not on the CPU"
    assert LeanLlama(meta).kernels == "generic" and StaticLlama(meta, compiled=False).kernels == "generic"
    static = StaticLlama(meta, compiled=True)  # compiled on the thread that will call it (compile_here), not at load
    assert static.compiles_here and static.generic._graph is None and not StaticLlama(meta).compiles_here


def graph_counter(graphs: list):
    """A torch.compile backend that keeps each graph dynamo hands it and runs it as traced."""

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend


def test_generic_steps_trace_whole_and_keep_their_shapes_as_the_cache_moves():
    """What CUDA graphs need, checked on the CPU: the generic step of the draft (one token; a fork's 3 branches) and
    of the target (one token; a 4-token verify pass) traces as one graph without a break (torch.compile fullgraph,
    and torch._dynamo.explain: no .item(), .tolist() or data-dependent shape); once each shape has compiled, steps at
    other positions, a rollback, a fork and its collapse compile nothing again (error_on_recompile): the position is a
    tensor, the buffers keep their shape; and the compiled steps give the eager ones' states."""
    from engine.models.static_forward import StaticLlama

    model = tiny_llama(seed=5)
    graphs = []
    lean, eager = LeanLlama(model, kernels="generic"), LeanLlama(model, kernels="generic")
    lean.compile_step(backend=graph_counter(graphs))
    assert lean.compile_state == "compiled" and lean.compile_why == "" and len(graphs) == 1  # the one-token step
    target, plain = StaticLlama(model, "generic", compiled=False), StaticLlama(model, "generic", compiled=False)
    target.generic.compile(backend=graph_counter(graphs))

    ids = torch.randint(0, 101, (1, 40), generator=torch.Generator().manual_seed(6))
    caches = {m: m.new_cache(64) for m in (lean, eager, target, plain)}

    def feed(models, x):
        out = [m(x, caches[m]) for m in models]
        out = [o[0] if isinstance(o, tuple) else o for o in out]
        torch.testing.assert_close(out[0], out[1], rtol=1e-6, atol=1e-6)

    def fork(k, tokens):
        for m in (lean, eager):
            caches[m].batch_repeat_interleave(k)
        feed((lean, eager), torch.tensor(tokens))

    with torch.inference_mode():
        for pair in ((lean, eager), (target, plain)):
            feed(pair, ids[:, :10])  # a prefill (of at most GRAPH_TOKENS: compiled too)
            feed(pair, ids[:, 10:11])
        fork(3, [[4], [5], [6]])  # the 3-branch step's shape
        feed((target, plain), ids[:, 11:15])  # the verify pass's
        for m in (lean, eager):
            caches[m].batch_select_indices(torch.tensor([1]))
        compiled = len(graphs)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for i in range(12, 30):
                feed((lean, eager), ids[:, i : i + 1])
                feed((target, plain), ids[:, i + 3 : i + 4] if i % 3 else ids[:, i : i + 4])
                if i % 3 == 0:
                    for m, n in ((lean, 1), (eager, 1), (target, 4), (plain, 4)):
                        caches[m].crop(-n)  # a rollback
                if i % 5 == 0:
                    fork(3, [[i % 7], [i % 5], [i % 3]])
                    fork(1, [[1], [2], [3]])  # the branches one token further (a fork of k branches into k)
                    for m in (lean, eager):
                        caches[m].batch_select_indices(torch.tensor([2]))
    assert len(graphs) == compiled and lean.compile_why == target.compile_why == ""
    assert all(isinstance(t, torch.Tensor) for t in caches[lean].keys)

    # the same, as torch._dynamo.explain sees it: one graph, no break, for each kind of step
    generic = target.generic
    for x, cache in ((ids[:, :1], generic.new_cache(32)), (ids[:, :4], generic.new_cache(32))):
        recorded = []
        generic._graph = lambda *args: recorded.append(args) or generic._step(*args)
        with torch.inference_mode():
            generic(x, cache)
            explained = torch._dynamo.explain(generic._step)(*recorded[0])
        assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons


def test_a_cuda_graph_step_marks_its_start_and_hands_back_a_copy(monkeypatch):
    """The CUDA-only branch of a compiled generic step, with CUDA faked (nothing else can run it here): each compiled
    step first tells CUDA graph trees that a new step begins (torch.compiler.cudagraph_mark_step_begin), and hands
    back a copy of the graph's output, which the next replay overwrites; a step with per-layer states, or longer
    than GRAPH_TOKENS, runs eager."""
    from engine.models import lean as lean_module
    from engine.models.lean import GRAPH_TOKENS, GenericDecoder

    outputs, marks = [], []

    def backend(gm, example_inputs):
        def run(*args):
            out = gm.forward(*args)
            outputs.append(out[0] if isinstance(out, (tuple, list)) else out)
            return out

        return run

    monkeypatch.setattr(GenericDecoder, "cuda_graphs", property(lambda self: self._graph is not None))
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    generic = GenericDecoder(tiny_llama(seed=2))
    generic.compile(backend=backend)
    cache = generic.new_cache(64)
    ids = torch.randint(0, 101, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        x, _ = generic(ids[:, :4], cache)
        assert len(marks) == 1 and outputs and x.data_ptr() != outputs[-1].data_ptr()
        torch.testing.assert_close(x, outputs[-1])
        generic(ids[:, 4:5], cache, hidden_states=True)  # eager: no mark
        generic(ids[:, 5 : 6 + GRAPH_TOKENS], cache)
        assert len(marks) == 1
    assert lean_module.compile_mode("cuda") == "reduce-overhead"


def test_a_new_static_cache_takes_the_buffers_of_one_that_is_gone():
    """A generic cache's buffers are static addresses (so a CUDA graph reads and writes them in place), and a run's
    new cache takes those of the last run's once that one is gone (so a graph recorded on them replays), never those
    of a cache still alive; room a fork makes is zeros (whole-buffer attention reads it, masked)."""
    import gc

    from engine.models.lean import GenericDecoder

    generic = GenericDecoder(tiny_llama(seed=2))
    a = generic.new_cache()
    ptrs = [t.data_ptr() for t in a.keys + a.values]
    assert all(getattr(t, "_dynamo_static_input_type", None) for t in a.keys + a.values)
    b = generic.new_cache()
    assert not {t.data_ptr() for t in b.keys + b.values} & set(ptrs)
    del a
    gc.collect()
    c = generic.new_cache()
    assert [t.data_ptr() for t in c.keys + c.values] == ptrs and c.length == 0
    with torch.inference_mode():
        generic(torch.tensor([[1, 2, 3]]), c)
    c.batch_repeat_interleave(2)  # a KVBuffer's fork: new rows, zeros past what is held, marked
    assert c.keys[0].shape[0] == 2 and not c.keys[0][:, :, 3:].any()
    assert getattr(c.keys[0], "_dynamo_static_input_type", None)


def thread_bound(compile_, runs: list):
    """torch.compile whose compiled steps keep per-thread state as CUDA graph trees do: one runs only on the thread
    that compiled it, and raises on another. Each graph's run is kept as the name of the thread it ran on."""

    def backend(gm, example_inputs):
        def run(*args):
            runs.append(threading.current_thread().name)
            return gm.forward(*args)

        return run

    def compile_here(fn, **kwargs):
        kwargs.pop("mode", None)  # CUDA graphs' mode: the thread check below stands in for them
        compiled, owner = compile_(fn, **{**kwargs, "backend": backend}), threading.get_ident()

        def step(*args, **kw):
            if threading.get_ident() != owner:
                raise RuntimeError("a step compiled on another thread")
            return compiled(*args, **kw)

        return step

    return compile_here


def test_compiled_steps_compile_and_run_on_their_models_worker_thread(tmp_path, monkeypatch):
    """Issue 49: compiled on the loading thread (the target's shapes by its probe at load, the draft's warm-up) and
    called from the workers' threads, a step whose graphs keep per-thread state (CUDA graph trees) failed there and
    stayed eager for good, without a word. The steps compile on the thread of the worker that calls them, and a
    second engine on the same target runs its steps on that same thread; a step that fails says so in a notice."""
    from engine.engine import Engine
    from engine.models import static_forward
    from engine.models.loading import LM, ModelPair, load_model

    from .conftest import make_tiny_model

    runs = []
    monkeypatch.setattr(torch, "compile", thread_bound(torch.compile, runs))
    monkeypatch.setattr(static_forward, "compile_mode", lambda device: "reduce-overhead")  # the target, as on CUDA
    cpu = torch.device("cpu")
    models = {
        n: load_model(str(make_tiny_model(tmp_path / str(n), seed=1, layers=n)), cpu, torch.float32) for n in (1, 2, 3)
    }
    (target, tok), vocab = models[2], models[2][0].config.vocab_size
    lm = LM("t", target, tok, vocab, static=True, kernels="generic")
    engines = [
        Engine(ModelPair(lm, LM(f"d{n}", models[n][0], tok, vocab, lean=True, compiled=True, kernels="generic")))
        for n in (1, 3)
    ]
    try:
        prompt, outputs = [2, 3, 4, 5], []
        for engine in engines:
            want = engine.run(prompt, GenerationConfig(method="ar", max_new_tokens=20)).token_ids
            runs.clear()
            result = engine.run(prompt, GenerationConfig(method="specbranch", max_new_tokens=20, gamma=3))
            outputs.append((result.token_ids == want, set(runs), [e for e in result.events if e.type == "notice"]))
            assert engine.pair.target.compile_why == engine.pair.draft.compile_why == ""
    finally:
        for engine in engines:
            engine.close()
    assert [ok for ok, _, _ in outputs] == [True, True]
    target_thread = {name for name in outputs[0][1] if name.startswith("specbranch-target")}
    for _, threads, notices in outputs:  # compiled steps of both models ran, each on its own worker's one thread
        assert {name.split("_")[0] for name in threads} == {"specbranch-target", "specbranch-draft"}, threads
        assert {name for name in threads if name.startswith("specbranch-target")} == target_thread
        assert not [n for n in notices if "eager" in n.message]


def test_several_decoders_compile_each_within_dynamos_recompile_limit():
    """Dynamo keeps its compiled graphs, and its limit of 8 recompiles, per code object. The generic step is one
    method of the class: a target and its drafts (their layer counts differ, so do their guards), each compiling a few
    shapes, used to share that limit, and past it a step failed for good (FailOnRecompileLimitHit: the fifth decoder
    here). Each decoder compiles a code object of its own."""
    from engine.models.lean import GenericDecoder

    whys = []
    for layers in range(1, 6):
        generic = GenericDecoder(tiny_llama(seed=layers, num_hidden_layers=layers))
        generic.compile(backend=graph_counter([]))
        cache = generic.new_cache(64)
        with torch.inference_mode():
            for t in (1, 3, 1, 2):  # a step, a verify pass, a step, a shorter pass
                generic(torch.randint(0, 101, (1, t), generator=torch.Generator().manual_seed(t)), cache)
        whys.append(generic.compile_why)
    assert whys == [""] * 5


def test_a_compiled_step_that_fails_says_so_in_the_run(tmp_path, monkeypatch):
    """A compiled step that fails leaves the model's steps eager (the same output, slower): the run says so in a
    warning notice, once per engine, with the reason, where before the failure went unsaid."""
    from engine.engine import Engine
    from engine.models.loading import LM, ModelPair, load_model

    from .conftest import make_tiny_model

    def failing(fn, **kwargs):
        def step(*args, **kw):
            raise RuntimeError("no kernel for this shape")

        return step

    monkeypatch.setattr(torch, "compile", failing)
    cpu = torch.device("cpu")
    target, tok = load_model(str(make_tiny_model(tmp_path / "t", seed=1)), cpu, torch.float32)
    draft, _ = load_model(str(make_tiny_model(tmp_path / "d", seed=1, layers=1)), cpu, torch.float32)
    vocab = target.config.vocab_size
    pair = ModelPair(
        LM("t", target, tok, vocab, static=True, kernels="generic"),
        LM("d", draft, tok, vocab, lean=True, compiled=True, kernels="generic"),
    )
    engine = Engine(pair)
    try:
        runs = [engine.run([2, 3, 4], GenerationConfig(method=m, max_new_tokens=12, gamma=3)) for m in ("sd", "ar")]
    finally:
        engine.close()
    said = [[e.message for e in run.events if e.type == "notice" and "eager" in e.message] for run in runs]
    assert said == [["the draft's steps run eager, not compiled (the same output, slower): RuntimeError: no kernel for "
                     "this shape"], []]  # fmt: skip
    assert runs[0].token_ids == runs[1].token_ids

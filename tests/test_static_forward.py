"""The target's static-cache forward (engine/models/static_forward.py) computes transformers' forward bit for bit: the
same logits, features and per-layer hidden states (torch.equal, not a tolerance) through prefill, single steps, verify
passes, rollbacks and a cache that outgrows its buffers, on a tiny random Llama and on the embedded target; and it
is used only where it fits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import SpecBranchError
from engine.kernels.lm_head import HeadMatmul, fast_linears
from engine.models.lean import KVBuffer
from engine.models.llama import TokenTree
from engine.models.loading import LM, static_target
from engine.models.static_forward import StaticLlama, fits

from .test_lean import tiny_llama


def assert_same_passes(static: LM, plain: LM, ids: torch.Tensor, cache_capacity: int | None = None) -> None:
    """Feed both LMs the same passes (a prefill, 1-token steps, verify passes) with rollbacks between them, as the
    engine does, and require identical outputs."""
    a = static._static.new_cache(cache_capacity) if cache_capacity else static.new_cache()
    b = plain.new_cache()
    assert isinstance(a, KVBuffer) and not isinstance(b, KVBuffer)
    n = ids.shape[1]
    cuts = [0, n // 2, n // 2 + 1, n // 2 + 5, n // 2 + 6]  # prefill, a step, a 4-token pass, a step
    for i, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
        hidden = i % 2 == 0  # H-RAD reads the hidden states: they must match too
        x, y = (
            static.forward(ids[:, lo:hi], a, hidden_states=hidden, features=True),
            plain.forward(ids[:, lo:hi], b, hidden_states=hidden, features=True),
        )
        assert torch.equal(x.logits, y.logits) and torch.equal(x.features, y.features)
        if hidden:
            assert len(x.hidden_states) == len(y.hidden_states)
            assert all(torch.equal(p, q) for p, q in zip(x.hidden_states, y.hidden_states))
    for cache in (a, b):  # a rejected verify pass: roll both back by 3, then verify another block
        cache.crop(-3)
    assert a.get_seq_length() == b.get_seq_length() == cuts[-1] - 3
    rest = ids[:, cuts[-1] - 3 :]
    assert torch.equal(static.forward(rest, a), plain.forward(rest, b))
    assert a.get_seq_length() == b.get_seq_length() == n


def fused(static) -> list:
    """The stacked q, k, v and gate, up products of every layer."""
    return [w.qkv for w in static.weights] + [w.gate_up for w in static.weights]


def test_static_forward_is_bit_identical_on_a_tiny_llama():
    """Grouped-query attention and scaled rotary embeddings; a buffer of 8 positions grows past its size twice. LM
    routes the linears as the engine routes a target's (fast_linears), so q, k, v and gate, up run as one stacked
    matmul each."""
    model = tiny_llama(seed=6)
    ids = torch.randint(0, 101, (1, 30), generator=torch.Generator().manual_seed(7))
    static, plain = LM("tiny", model, None, 101, static=True), LM("tiny", model, None, 101)
    assert static.static and static._static is not None and plain._static is None
    assert all(isinstance(f, HeadMatmul) for f in fused(static._static))
    # built and checked once per model: another LM over it (models.pair_of's re-wrap) reuses it
    assert LM("tiny", model, None, 90, static=True)._static is static._static
    assert_same_passes(static, plain, ids, cache_capacity=8)


def test_linears_routed_otherwise_run_one_by_one():
    """Where the linears are not routed alike (here: transformers' own), the path calls them one by one and
    concatenates: transformers' bits again."""
    model = tiny_llama(seed=10)
    static = StaticLlama(model)
    assert not any(isinstance(f, HeadMatmul) for f in fused(static))
    assert static.agrees(model)


def test_the_probe_catches_a_path_that_differs():
    """StaticLlama.agrees is what keeps a machine whose BLAS computes a stacked matmul otherwise on transformers'
    forward: one layer's stacked q, k, v off by about an ulp fails it."""
    model = tiny_llama(seed=9)
    fast_linears(model, "float32")
    static = StaticLlama(model)
    assert static.agrees(model)
    first = static.weights[1].qkv
    static.weights[1] = dataclasses.replace(static.weights[1], qkv=lambda x: first(x) * (1 + 1e-6))
    assert not static.agrees(model)


def test_a_masked_pass_hands_sdpa_the_kv_heads_and_keeps_the_bits(monkeypatch):
    """A verify pass (a mask over the cache) goes to sdpa with the KV heads and enable_gqa, not transformers' repeated
    copies, and gives transformers' bits all the same (agrees, and assert_same_passes: a prefill, steps, a 4-token
    verify pass and, after a rollback, a 21-token one). Where those bits differ (here: sdpa's grouped sum nudged by
    an ulp), static_llama falls back to transformers' copies, not to transformers' whole forward."""
    model = tiny_llama(seed=12)
    fast_linears(model, "float32")
    static = StaticLlama(model)
    assert static.grouped and static.agrees(model)
    real = torch.nn.functional.scaled_dot_product_attention
    grouped_calls = []

    def counted(*args, **kwargs):
        grouped_calls.append(kwargs.get("enable_gqa", False) and kwargs.get("attn_mask") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    plain = LM("tiny", model, None, 101)
    lm = LM("tiny", model, None, 101, static=True)
    ids = torch.randint(0, 101, (1, 48), generator=torch.Generator().manual_seed(4))
    assert_same_passes(lm, plain, ids)
    assert any(grouped_calls)

    def nudged(*args, **kwargs):
        out = real(*args, **kwargs)
        return out * (1 + 1e-6) if kwargs.get("enable_gqa") and kwargs.get("attn_mask") is not None else out

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", nudged)
    other = tiny_llama(seed=13)
    fast_linears(other, "float32")
    path = LM("tiny", other, None, 101, static=True)._static
    assert path is not None and not path.grouped


def test_static_forward_is_bit_identical_on_the_embedded_target(embedded_target):
    """The target the app serves: loaded with the static path by default, and through it the same bits as
    transformers' forward over a 150-token prompt and the passes after it."""
    target = embedded_target.target
    assert target.static
    plain = LM(target.name, target.model, target.tokenizer, target.vocab_size)
    ids = torch.randint(100, 40000, (1, 160), generator=torch.Generator().manual_seed(8))
    assert_same_passes(target, plain, ids)


def test_static_forward_only_where_it_fits():
    assert fits(tiny_llama()) is None
    assert "attention_bias" in fits(tiny_llama(attention_bias=True))  # what the lean path refuses, it refuses
    eager = tiny_llama()
    eager.config._attn_implementation = "eager"  # its masks are not the ones StaticLlama.mask builds
    assert fits(eager) == "attention eager"
    with pytest.raises(ValueError, match="does not fit this model: attention eager"):
        StaticLlama(eager)
    assert static_target(tiny_llama(), "static") and not static_target(tiny_llama(), "transformers")
    assert not static_target(eager, "static")  # transformers' forward then, with its own cache
    assert not isinstance(LM("tiny", eager, None, 101, static=static_target(eager, "static")).new_cache(), KVBuffer)
    with pytest.raises(SpecBranchError, match="unknown target forward 'fast'; choose one of static, transformers"):
        static_target(tiny_llama(), "fast")


@pytest.mark.parametrize("kernels", ["cpu", "generic"])
def test_a_token_tree_pass_gives_each_line_its_own_rows_and_keeps_one_line(kernels):
    """SpecBranch's target verifies a path and its fork's branches in one pass (llama.TokenTree). Each branch's rows
    are those its line gets fed alone (up to rounding: the pass has other rows and a mask), and after the verdict the
    cache keeps one line (KVBuffer.keep: the branch's K and V moved behind the path), so the next pass computes what it
    would after that line alone. The reference is transformers' own forward over each line."""
    model = tiny_llama(seed=11)
    lm = LM("tiny", model, None, 101, static=kernels == "cpu", kernels=kernels)
    lm._static = lm._static or StaticLlama(model, "generic", compiled=False)
    g = torch.Generator().manual_seed(3)
    prompt, path = torch.randint(0, 101, (1, 6), generator=g), [5, 9]
    branches = [[17, 4], [23, 8, 40], [61]]
    feed = path + [t for b in branches for t in b]
    parents, at = [-1, 0], 2
    for b in branches:  # each branch a line hanging off the path's last token
        parents += [1] + list(range(at, at + len(b) - 1))
        at += len(b)
    tree = TokenTree(tuple(parents))
    cache = lm.new_cache()
    lm.forward(prompt, cache)
    got = lm.forward(torch.tensor([feed]), cache, tree=tree)[0]  # [T, V]
    at = 2
    for b in branches:
        line = torch.cat([prompt, torch.tensor([path + b])], 1)
        want = model(line).logits[0, -len(path) - len(b) :]  # transformers' own rows of the path and this branch
        rows = [0, 1] + list(range(at, at + len(b)))
        assert torch.allclose(got[rows], want, atol=1e-4) and torch.equal(got[rows].argmax(-1), want.argmax(-1))
        at += len(b)
    kept = [0, 1, 4, 5, 6]  # the path, then the second branch
    cache.keep(prompt.shape[1], kept)
    assert cache.get_seq_length() == prompt.shape[1] + len(kept)
    nxt = lm.forward(torch.tensor([[77]]), cache)[0, -1]
    want = model(torch.cat([prompt, torch.tensor([path + branches[1] + [77]])], 1)).logits[0, -1]
    assert torch.allclose(nxt, want, atol=1e-4)

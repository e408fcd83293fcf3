"""KV-cache rollback: after cropping and re-feeding, logits equal those of a fresh forward pass."""

from __future__ import annotations

import torch

from engine.models import cache as kv


def check_rollback(lm, prompt, speculative, replacement):
    with torch.inference_mode():
        c = kv.new_cache(lm.model)
        lm.forward(torch.tensor([prompt]), c)
        lm.forward(torch.tensor([speculative]), c)
        assert kv.cache_length(c) == len(prompt) + len(speculative)
        removed = kv.rollback(c, len(prompt))
        assert removed == len(speculative) and kv.cache_length(c) == len(prompt)
        after = lm.forward(torch.tensor([replacement]), c)[0]
        fresh = lm.forward(torch.tensor([prompt + replacement]), kv.new_cache(lm.model))[0, len(prompt) :]
    torch.testing.assert_close(after, fresh, rtol=1e-4, atol=1e-4)


def test_rollback_tiny(tiny_engine):
    check_rollback(tiny_engine.pair.target, [2, 3, 4, 5], [6, 7, 8], [9, 2])


def test_rollback_embedded(embedded_target):
    tok = embedded_target.tokenizer
    prompt = tok.encode("The capital of France is")
    check_rollback(embedded_target.target, prompt, tok.encode(" Berlin, which is"), tok.encode(" Paris."))


def test_rollback_refuses_to_grow(tiny_engine):
    import pytest

    c = kv.new_cache(tiny_engine.pair.target.model)
    tiny_engine.pair.target.forward(torch.tensor([[2, 3]]), c)
    with pytest.raises(ValueError, match="cannot roll a cache of 2 positions back to 5"):
        kv.rollback(c, 5)

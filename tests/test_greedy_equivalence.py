"""Greedy speculative decoding must reproduce the target's own greedy `generate()` token for token
(embedded SmolLM2 target, float32 CPU), with the target as its own draft and with a different draft."""
from __future__ import annotations

import pytest
import torch

from engine.config import GenerationConfig
from engine.events import Rollback

from .conftest import engine_with_draft

PROMPTS = [
    ("Explain why the sky is blue in two sentences.", True),
    ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
     "How many clips did Natalia sell altogether in April and May?", True),
    ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", False),
]
NEW = 128


@pytest.fixture(scope="module")
def references(embedded_target):
    engine = engine_with_draft(embedded_target, "self")
    model = embedded_target.target.model
    refs = []
    for text, chat in PROMPTS:
        ids = engine.encode(text, chat)
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)
        refs.append((ids, out[0, len(ids):].tolist()))
    return refs


def test_ar_matches_generate(embedded_target, references):
    engine = engine_with_draft(embedded_target, "self")
    for ids, want in references:
        assert engine.run(ids, GenerationConfig(method="ar", max_new_tokens=NEW)).token_ids == want


def test_self_speculation_accepts_everything_and_matches(embedded_target, references):
    engine = engine_with_draft(embedded_target, "self")
    for ids, want in references:
        r = engine.run(ids, GenerationConfig(method="sd", max_new_tokens=NEW, gamma=4))
        assert r.token_ids == want
        assert r.metrics["acceptance_rate"] == 1.0
        # nothing is rolled back; the only waste is the tail of the last block, drafted past EOS
        assert not any(isinstance(e, Rollback) for e in r.events)
        assert r.metrics["wasted_draft_rate"] == r.metrics["path_rollback_rate"]
        assert r.metrics["wasted_draft_tokens"] < 4


def test_different_draft_matches(embedded_target, references):
    """A 4-layer layer-skip draft disagrees often: many rejections and rollbacks, same output."""
    engine = engine_with_draft(embedded_target, "truncated:4")
    rejected = 0
    for ids, want in references:
        r = engine.run(ids, GenerationConfig(method="sd", max_new_tokens=NEW, gamma=2))
        assert r.token_ids == want
        rejected += r.metrics["wasted_draft_tokens"]
    assert rejected > 0

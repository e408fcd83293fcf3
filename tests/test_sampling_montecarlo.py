"""Monte Carlo through the real engine on tiny random-weight models: the first emitted tokens of
speculative decoding must follow the target's own (processed) distribution; chi-square test."""
from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from engine.config import GenerationConfig
from engine.methods.sampling import logits_to_probs

PROMPT = [2, 3, 4]
N = 1500


def exact_joint(model, prompt, length, cfg, vocab):
    """P(first `length` tokens) under `model` with cfg's temperature/top-k/top-p, by enumeration."""
    out = {}
    with torch.inference_mode():
        for seq in itertools.product(range(vocab), repeat=length):
            ids = torch.tensor([prompt + list(seq)])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]
            probs = logits_to_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p).double()
            out[seq] = float(torch.prod(torch.stack([probs[i, t] / probs[i].sum() for i, t in enumerate(seq)])))
    return out


def chi_square(counts: dict, expected: dict, n: int) -> float:
    keys = sorted(expected)
    obs = [counts.get(k, 0) for k in keys]
    exp = [expected[k] * n for k in keys]
    # pool rare cells so every expected count is >= 5
    big = [(o, e) for o, e in zip(obs, exp) if e >= 5]
    small_o, small_e = sum(o for o, e in zip(obs, exp) if e < 5), sum(e for e in exp if e < 5)
    o = [b[0] for b in big] + ([small_o] if small_e > 0 else [])
    e = [b[1] for b in big] + ([small_e] if small_e > 0 else [])
    e = [x * sum(o) / sum(e) for x in e]
    return chisquare(o, e).pvalue


@pytest.mark.parametrize("cfg", [
    GenerationConfig(method="sd", temperature=1.0, gamma=2, max_new_tokens=3),
    GenerationConfig(method="sd", temperature=0.7, top_k=6, top_p=0.9, gamma=3, max_new_tokens=3),
])
def test_sd_first_tokens_follow_target(tiny_engine, cfg):
    vocab = tiny_engine.pair.target.vocab_size
    counts: dict = {}
    accepted = 0
    for seed in range(N):
        r = tiny_engine.run(PROMPT, GenerationConfig(**{**cfg.to_dict(), "seed": seed}))
        key = tuple(r.token_ids[:3])
        counts[key] = counts.get(key, 0) + 1
        accepted += r.metrics["accepted_tokens"]
    assert accepted > N * 0.1, "the draft must get tokens accepted, or this tests only the target"
    target = exact_joint(tiny_engine.pair.target.model, PROMPT, 3, cfg, vocab)
    assert chi_square(counts, target, N) > 1e-3
    # negative control: the same samples are clearly *not* distributed like the draft
    draft = exact_joint(tiny_engine.pair.draft.model, PROMPT, 3, cfg, vocab)
    assert chi_square(counts, draft, N) < 1e-6

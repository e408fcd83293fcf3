"""Sampling and the exact verification rules of speculative decoding.

All probabilities here are the *exact* distributions tokens are drawn from: `logits_to_probs`
applies temperature, top-k and top-p and returns the float32 row that `sample` then draws from,
so the q recorded for a draft token is precisely the q it was sampled from.
Temperature 0 gives a one-hot row (greedy); the same rules then reduce to "accept iff argmax matches".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def logits_to_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits [..., V] -> probs [..., V] float32 on CPU, after temperature, top-k and top-p."""
    logits = logits.detach().float().cpu()
    if temperature == 0.0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already cover top_p (the first one always stays)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from a 1-D probability row (argmax when the row is one-hot)."""
    if float(probs.max()) == 1.0:
        return int(probs.argmax())
    return int(torch.multinomial(probs, 1, generator=generator))


def uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator))


def accept_probability(p: torch.Tensor, q: torch.Tensor, token: int) -> float:
    """Leviathan et al.: accept a token drawn from q with probability min(1, p(x)/q(x))."""
    return min(1.0, float(p[token]) / float(q[token]))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """After a rejection, the next token is drawn from norm(max(p - q, 0))."""
    r = (p - q).clamp_min(0)
    total = r.sum()
    # total == 0 only when p == q, where rejection has probability 0; p is the right answer then
    return p if float(total) <= 0 else r / total


@dataclass
class Verdict:
    accepted: int  # length of the accepted prefix of the draft block
    next_token: int  # correction (rejection) or bonus (all accepted)
    next_p: float  # probability of next_token under the distribution it was drawn from
    bonus: bool
    p: list[float]  # p(x_i) for every verified draft token
    q: list[float]  # q(x_i) for every verified draft token
    u: list[float]  # uniform draws (-1 where greedy needs none)


def verify_block(tokens: list[int], q_rows: torch.Tensor, p_rows: torch.Tensor,
                 generator: torch.Generator | None, greedy: bool) -> Verdict:
    """Verify draft tokens x_1..x_g (q_rows [g, V]) against target rows p_rows [g+1, V]."""
    p_of, q_of, us = [], [], []
    for i, x in enumerate(tokens):
        p_of.append(float(p_rows[i, x]))
        q_of.append(float(q_rows[i, x]))
        a = accept_probability(p_rows[i], q_rows[i], x)
        u = -1.0 if greedy else uniform(generator)
        us.append(u)
        if (a == 1.0) if greedy else (u < a):
            continue
        residual = residual_distribution(p_rows[i], q_rows[i])
        token = sample(residual, generator)
        return Verdict(i, token, float(residual[token]), False, p_of, q_of, us)
    bonus_row = p_rows[len(tokens)]
    token = sample(bonus_row, generator)
    return Verdict(len(tokens), token, float(bonus_row[token]), True, p_of, q_of, us)


def top_alternatives(probs: torch.Tensor, k: int = 3) -> list[list[float]]:
    """[[token_id, prob], ...] for the k most likely tokens of a row (for the UI's hover and trees)."""
    values, ids = torch.topk(probs, min(k, probs.shape[-1]))
    return [[int(i), round(float(v), 6)] for v, i in zip(values, ids) if float(v) > 0]

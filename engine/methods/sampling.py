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
    """Draw one token id from a 1-D probability row (argmax when the row is one-hot), by inverse CDF in float64
    (sample_at), U ~ Uniform[0, 1). Why not torch.multinomial: over a 49k-token row it costs 1.05 ms on one CPU thread
    against 0.07 ms for this, and a sampled round draws several tokens on the host, between the forwards
    (docs/methods.md)."""
    if float(probs.max()) == 1.0:
        return int(probs.argmax())
    return sample_at(probs, draw_u(generator))


def draw_u(generator: torch.Generator | None) -> float:
    """U ~ Uniform[0, 1) in float64: 53 bits, not 24."""
    return float(torch.rand((), generator=generator, dtype=torch.float64))


def sample_at(probs: torch.Tensor, u: float) -> int:
    """The token at U = u of a 1-D probability row's inverse CDF: the first token whose cumulative mass exceeds
    u · total, so with u ~ Uniform[0, 1) token i comes with probability probs[i] / total (a token of mass 0 never: its
    CDF step is empty). A one-hot row gives its token whatever u is."""
    if float(probs.max()) == 1.0:
        return int(probs.argmax())
    cdf = probs.double().cumsum(-1)
    x = u * float(cdf[-1])
    i = int(torch.searchsorted(cdf, torch.tensor(x, dtype=torch.float64, device=cdf.device), right=True))
    return i if i < len(cdf) else int(probs.nonzero().max())  # u rounded up to the total: the last token with mass


@dataclass(frozen=True)
class NextDraw:
    """How the engine picks a draft row's next token, fixed before the forward that computes the row: its sampling
    settings and the uniform u it will invert the row's CDF at (drawn beforehand from the draft's generator; 0 when
    greedy, whose row is one-hot). So a draft in its own process can take the step on that token at once, while the
    engine reads the row (draft_process.step_ahead), when sampling as when greedy. The engine picks by its own
    probabilities (`token`); the child's guess (`guess`) is only a guess: where it differs the step is undone."""
    temperature: float
    top_k: int
    top_p: float
    u: float = 0.0

    def token(self, probs: torch.Tensor) -> int:
        """The token this draw gives on the row `probs` (what the engine drafts)."""
        return sample_at(probs, self.u)

    def guess(self, logits: torch.Tensor) -> int:
        """The same draw on a row of logits [V], read through the same settings."""
        return self.token(logits_to_probs(logits, self.temperature, self.top_k, self.top_p))


def uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator))


class Draws:
    """The random draws of verification, behind two calls, so that a test can replace them by an exact
    enumeration of their outcomes (tests/exact_draws.py). This one draws from a torch generator."""

    def __init__(self, generator: torch.Generator | None):
        self.generator = generator

    def accept(self, a: float) -> tuple[float, bool]:
        """Draw U ~ Uniform[0, 1) and accept with probability a: (U, U < a)."""
        u = uniform(self.generator)
        return u, u < a

    def sample(self, probs: torch.Tensor) -> int:
        return sample(probs, self.generator)


def as_draws(generator: torch.Generator | Draws | None) -> Draws:
    return generator if isinstance(generator, Draws) else Draws(generator)


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
    next_token: int | None  # correction (rejection) or bonus (all accepted); None: all accepted, no bonus row
    next_p: float  # probability of next_token under the distribution it was drawn from
    bonus: bool
    p: list[float]  # p(x_i) for every verified draft token
    q: list[float]  # q(x_i) for every verified draft token
    u: list[float]  # uniform draws (-1 where greedy needs none)


def verify_block(tokens: list[int], q_rows: torch.Tensor, p_rows: torch.Tensor,
                 generator: torch.Generator | Draws | None, greedy: bool) -> Verdict:
    """Verify draft tokens x_1..x_g (q_rows [g, V]) against target rows p_rows [g+1, V] (or [g, V]:
    then nothing is drawn when all are accepted, because the caller resolves that position itself)."""
    draws = as_draws(generator)
    p_of, q_of, us = [], [], []
    for i, x in enumerate(tokens):
        p_of.append(float(p_rows[i, x]))
        q_of.append(float(q_rows[i, x]))
        u, accepted = decide(accept_probability(p_rows[i], q_rows[i], x), draws, greedy)
        us.append(u)
        if accepted:
            continue
        residual = residual_distribution(p_rows[i], q_rows[i])
        token = draws.sample(residual)
        return Verdict(i, token, float(residual[token]), False, p_of, q_of, us)
    if len(p_rows) == len(tokens):
        return Verdict(len(tokens), None, 0.0, False, p_of, q_of, us)
    bonus_row = p_rows[len(tokens)]
    token = draws.sample(bonus_row)
    return Verdict(len(tokens), token, float(bonus_row[token]), True, p_of, q_of, us)


def decide(a: float, draws: Draws, greedy: bool) -> tuple[float, bool]:
    """(u, accepted) for an acceptance probability a; greedy draws nothing and accepts iff a == 1."""
    return (-1.0, a == 1.0) if greedy else draws.accept(a)


def top_alternatives(probs: torch.Tensor, k: int = 3) -> list[list[float]]:
    """[[token_id, prob], ...] for the k most likely tokens of a row (for the UI's hover and trees)."""
    values, ids = torch.topk(probs, min(k, probs.shape[-1]))
    return [[int(i), round(float(v), 6)] for v, i in zip(values, ids) if float(v) > 0]


# ---------------------------------------------------------------- several candidates at one position
# A branch point offers k candidate tokens x_1..x_k. Which exact rule keeps the output distributed as p
# depends on how the candidates were drawn (docs/specbranch.md (SpecBranch)); each rule below is one step of a chain:
# try candidate i against p_i, and on rejection move on to p_{i+1}; after the last, sample from p_{k+1}.
TOPK, IID, NO_REPLACEMENT = "topk", "iid", "without_replacement"


def draw_candidates(q: torch.Tensor, k: int, scheme: str, generator: torch.Generator | None) -> list[int]:
    """k candidates from the draft row q: its top-k (deterministic), i.i.d. samples, or samples
    without replacement (never more than the support holds)."""
    support = int((q > 0).sum())
    if scheme == TOPK:
        return [int(i) for i in torch.topk(q, min(k, support)).indices]
    if scheme == IID:
        return [sample(q, generator) for _ in range(k)]
    if scheme == NO_REPLACEMENT:  # one at a time, each from q without the ones before it: what candidate_q reads
        drawn: list[int] = []
        for _ in range(min(k, support)):
            drawn.append(sample(candidate_q(q, drawn, scheme), generator))
        return drawn
    raise ValueError(f"unknown candidate scheme {scheme!r}")


def candidate_q(q: torch.Tensor, earlier: list[int], scheme: str) -> torch.Tensor:
    """The distribution candidate i was drawn from, given the candidates drawn before it."""
    if scheme != NO_REPLACEMENT or not earlier:
        return q
    q = q.clone()
    q[earlier] = 0
    return q / q.sum()


def candidate_step(p_i: torch.Tensor, q_i: torch.Tensor, x: int, scheme: str) -> tuple[float, torch.Tensor]:
    """(probability of accepting candidate x under p_i, p_{i+1} to use if it is rejected)."""
    if scheme == TOPK:  # a point mass at x: accept with p_i(x), else remove x from p_i
        rest = p_i.clone()
        rest[x] = 0
        total = rest.sum()
        return float(p_i[x]), (rest / total if float(total) > 0 else p_i)
    return accept_probability(p_i, q_i, x), residual_distribution(p_i, q_i)


@dataclass
class CandidateVerdict:
    index: int | None  # which candidate survived (None: all rejected)
    token: int  # the surviving candidate, or the token sampled from p_{k+1}
    prob: float  # probability of `token` under the distribution it was finally drawn from
    p: list[float]  # p(x_i) for each candidate (under the original p)
    u: list[float]  # the uniform draw for each tried candidate (-1 where greedy needs none)


def verify_candidates(p: torch.Tensor, q: torch.Tensor, candidates: list[int], scheme: str,
                      generator: torch.Generator | Draws | None, greedy: bool) -> CandidateVerdict:
    draws = as_draws(generator)
    p_i, us = p, []
    for i, x in enumerate(candidates):
        q_i = candidate_q(q, candidates[:i], scheme)
        a, p_next = candidate_step(p_i, q_i, x, scheme)
        u, accepted = decide(a, draws, greedy)
        us.append(u)
        if accepted:
            return CandidateVerdict(i, x, float(p[x]), [float(p[c]) for c in candidates], us)
        p_i = p_next
    token = draws.sample(p_i)
    return CandidateVerdict(None, token, float(p_i[token]), [float(p[c]) for c in candidates], us)

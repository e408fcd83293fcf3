"""Sampling and the exact verification rules of speculative decoding.

All probabilities here are the *exact* distributions tokens are drawn from: `logits_to_probs`
applies temperature, top-k and top-p and returns the float32 row that `sample` then draws from,
so the q recorded for a draft token is precisely the q it was sampled from.
Temperature 0 gives a one-hot row (greedy); the same rules then reduce to "accept iff argmax matches".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.kernels.vocab import argmax, as_numpy, top_indices


def logits_to_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits [..., V] -> probs [..., V] float32 on the logits' device (verification runs there: check_block), after
    temperature, top-k and top-p."""
    logits = logits.detach().float()
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
    """Draw one token id from a 1-D probability row (its token when the row is one-hot), by inverse CDF in float64
    on the row's device (inverse_cdf: the same token as sample_at), U ~ Uniform[0, 1), with one read of the row's
    device, the token. Why not torch.multinomial: over a 49k-token row it costs 1.05 ms on one CPU thread against
    0.07 ms for this (docs/methods.md)."""
    return int(inverse_cdf(probs, torch.tensor([draw_u(generator)], dtype=torch.float64, device=probs.device)))


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
    probabilities (`pick`); the child's guess (`guess`) is only a guess: where it differs the step is undone."""

    temperature: float
    top_k: int
    top_p: float
    u: float = 0.0

    def pick(self, probs: torch.Tensor) -> torch.Tensor:
        """The token this draw gives on the row `probs` (what the engine drafts), left on the row's device: []
        (long), read nowhere (inverse_cdf)."""
        return inverse_cdf(probs, torch.tensor([self.u], dtype=torch.float64, device=probs.device))

    def guess(self, logits: torch.Tensor) -> int:
        """pick() on a row of logits [V], read through the same settings (the draft's process steps ahead on it).
        Greedy: the row's argmax read through numpy (vocab.argmax, torch's token), not a one-hot row built by torch's
        argmax and scanned again: 0.11 ms on one thread against 8 µs (docs/results/README.md)."""
        if self.temperature == 0.0:
            return int(argmax(logits))
        return int(self.pick(logits_to_probs(logits, self.temperature, self.top_k, self.top_p)))


def uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator))


def to_host(values: torch.Tensor) -> list[float]:
    """The one place verification reads the device: a verdict's numbers, packed in one 1-D float64 tensor, as
    Python floats. On CUDA this waits for the stream the verdict was computed on (and so for the target's pass it
    read), nothing else; on a CPU it is a copy into a list."""
    return values.tolist()


def read_argmax(rows: torch.Tensor) -> list[int]:
    """Each row's argmax (rows [n, V]), torch's token, read in one read: on a CPU numpy's (engine/kernels/vocab.py:
    torch's CPU argmax does not vectorize), elsewhere through to_host."""
    a = as_numpy(rows)
    return a.argmax(-1).tolist() if a is not None else [int(t) for t in to_host(rows.argmax(-1))]


def read_top(probs: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """Each probability row's k largest values and their tokens (probs [n, V], every value >= 0), best first, in one
    read: on a CPU by numpy (vocab.top_indices; a tie goes to the first token), elsewhere torch.topk through
    to_host."""
    a = as_numpy(probs)
    if a is not None:
        ids = top_indices(a, k)  # [n, k]
        return np.take_along_axis(a, ids, -1).astype(np.float64).tolist(), ids.tolist()
    best = probs.topk(k, -1)  # [n, k] each
    v = to_host(torch.cat([best.values.double(), best.indices.double()], -1).flatten())  # [n * 2k]
    rows = [v[i * 2 * k : (i + 1) * 2 * k] for i in range(probs.shape[0])]
    return [r[:k] for r in rows], [[int(t) for t in r[k:]] for r in rows]


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """sample_at on the device: the token [...] (long) at U = u ([..., 1] float64) of rows [..., V]' inverse CDF,
    read nowhere. Where u · total rounds up to the total, the last token with mass (the first index whose CDF
    reaches it)."""
    cdf = probs.double().cumsum(-1)  # [..., V]
    total = cdf[..., -1:].contiguous()  # [..., 1]
    hit = torch.searchsorted(cdf, u * total, right=True)  # [..., 1]
    return torch.minimum(hit, torch.searchsorted(cdf, total))[..., 0]


class Draws:
    """The random draws of verification, behind two calls, so that a test can replace them by an exact
    enumeration of their outcomes (tests/exact_draws.py). This one draws from a torch generator, and decides on the
    rows' device: it never reads the probabilities it is given."""

    def __init__(self, generator: torch.Generator | None):
        self.generator = generator

    def accept(self, a: torch.Tensor, until: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """For acceptance probabilities a [n] tried in order: U_i ~ Uniform[0, 1) each, accepted where U_i < a_i:
        (U [n], accepted [n] bool), on a's device. Only the decisions up to the first that comes out `until` count
        (the rule stops there); this draws all n, so that nothing waits for a."""
        u = torch.rand(a.shape, generator=self.generator).to(a.device)
        return u, u < a

    def sample(self, probs: torch.Tensor, needed: torch.Tensor | None = None) -> torch.Tensor:
        """A token [] (long) drawn from the 1-D row by inverse CDF at a fresh U (float64), on the row's device.
        `needed` ([] bool, None = yes): whether the verdict uses it; this draws it either way."""
        u = torch.rand((), generator=self.generator, dtype=torch.float64).to(probs.device)
        return inverse_cdf(probs, u)


def as_draws(generator: torch.Generator | Draws | None) -> Draws:
    return generator if isinstance(generator, Draws) else Draws(generator)


def accept_probability(p: torch.Tensor, q: torch.Tensor, token) -> torch.Tensor:
    """Leviathan et al.: accept a token drawn from q with probability min(1, p(x)/q(x)). p, q [..., V]; token: an id
    (int) for 1-D rows, or ids [...] (long), one per row. Returns [...] float64 (the ratio of the rows' values in
    float64, as the host's floats did)."""
    if isinstance(token, int):
        px, qx = p[..., token], q[..., token]
    else:
        px, qx = p.gather(-1, token[..., None])[..., 0], q.gather(-1, token[..., None])[..., 0]
    return (px.double() / qx.double()).clamp(max=1.0)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """After a rejection, the next token is drawn from norm(max(p - q, 0)) (rows [..., V])."""
    r = (p - q).clamp_min_(0)  # in place: one [..., V] allocation for r
    total = r.sum(-1, keepdim=True)
    # total == 0 only when p == q, where rejection has probability 0; p is the right answer then
    return torch.where(total > 0, r.div_(total), p)


@dataclass
class Verdict:
    accepted: int  # length of the accepted prefix of the draft block
    next_token: int | None  # correction (rejection) or bonus (all accepted); None: all accepted, no bonus row
    next_p: float  # probability of next_token under the distribution it was drawn from
    bonus: bool
    p: list[float]  # p(x_i) for every verified draft token
    q: list[float]  # q(x_i) for every verified draft token
    u: list[float]  # uniform draws (-1 where greedy needs none)


@dataclass
class Pending:
    """A verdict computed on the rows' device, not read yet: `values` [n] float64 is all the host needs of it, and
    `read` makes the verdict from those numbers. `settle` reads any number of them in one transfer."""

    values: torch.Tensor
    read: Callable[[list[float]], object]


def settle(*pending: Pending | None) -> list:
    """Read pending verdicts (None: none there) with one host transfer (to_host) for all of them."""
    real = [p for p in pending if p is not None]
    values = to_host(real[0].values if len(real) == 1 else torch.cat([p.values for p in real]))
    out, at = [], 0
    for p in pending:
        if p is None:
            out.append(None)
            continue
        n = p.values.shape[0]
        out.append(p.read(values[at : at + n]))
        at += n
    return out


def first_false(flags: torch.Tensor) -> torch.Tensor:
    """[1] long: the index of the first False of flags [n] bool (n where all are True), on their device."""
    return flags.long().cumprod(0).sum().view(1)


def verify_block(
    tokens: list[int],
    q_rows: torch.Tensor,
    p_rows: torch.Tensor,
    generator: torch.Generator | Draws | None,
    greedy: bool,
) -> Verdict:
    """Verify draft tokens x_1..x_g (q_rows [g, V]) against target rows p_rows [g+1, V] (or [g, V]:
    then nothing is drawn when all are accepted, because the caller resolves that position itself).
    Computed on the rows' device; the verdict comes to the host in one transfer."""
    return settle(check_block(tokens, q_rows, p_rows, generator, greedy))[0]


def check_block(
    tokens: list[int],
    q_rows: torch.Tensor,
    p_rows: torch.Tensor,
    generator: torch.Generator | Draws | None,
    greedy: bool,
) -> Pending:
    """verify_block's arithmetic, left on the rows' device (Pending). Every token's acceptance is decided at once
    and the first rejection found there; the correction is drawn from the residual at that row, or the bonus from
    the row after the block. Greedy, rows are one-hot (logits_to_probs at T = 0): the rule accepts where p(x) = 1,
    draws nothing, and takes the target's argmax at the first rejection (the residual of two different one-hot
    rows is p's) or at the bonus row."""
    g, bonus_row = len(tokens), p_rows.shape[0] > len(tokens)
    if g == 0 and not bonus_row:  # nothing to judge, nothing to draw
        return Pending(p_rows.new_zeros(0, dtype=torch.float64), lambda v: Verdict(0, None, 0.0, False, [], [], []))
    draws = as_draws(generator)
    x = torch.tensor(tokens, dtype=torch.long, device=p_rows.device)  # [g]
    p_x = p_rows[:g].gather(-1, x[:, None])[:, 0]  # [g]
    q_x = q_rows[:g].gather(-1, x[:, None])[:, 0]  # [g]
    if greedy:  # a = min(1, p/q) is 1 exactly where p(x) >= q(x)
        u, accepted = None, p_x >= q_x
    else:
        u, accepted = draws.accept(accept_probability(p_rows[:g], q_rows[:g], x), until=False)
    n = first_false(accepted)  # [1]: the accepted prefix's length
    p_n = p_rows.index_select(0, n.clamp(max=p_rows.shape[0] - 1))[0]  # [V]: the rejected token's row, or the bonus row
    row = p_n
    if greedy:
        token = p_n.argmax().view(1)
    else:
        if g:
            q_n = q_rows.index_select(0, n.clamp(max=g - 1))[0]  # [V]
            residual = residual_distribution(p_n, q_n)
            row = torch.where(n < g, residual, p_n) if bonus_row else residual
        token = draws.sample(row, None if bonus_row else n < g).view(1)
    # one tensor (torch.cat promotes the ids to the rows' float dtype: exact below 2^24, beyond any vocabulary)
    packed = [p_x, q_x] + ([] if greedy else [u]) + [n, token, row.gather(0, token)]

    def read(v: list[float]) -> Verdict:
        n, token, next_p = int(v[-3]), int(v[-2]), v[-1]
        m = min(n + 1, g)  # the tokens tried: the accepted ones and the one rejected
        us = [-1.0] * m if greedy else v[2 * g : 2 * g + m]
        if n < g:
            return Verdict(n, token, next_p, False, v[:m], v[g : g + m], us)
        if not bonus_row:
            return Verdict(g, None, 0.0, False, v[:m], v[g : g + m], us)
        return Verdict(g, token, next_p, True, v[:m], v[g : g + m], us)

    return Pending(torch.cat(packed).double(), read)


def greedy_block(tokens: list[int], best: list[int], ends: bool) -> Verdict:
    """verify_block at T=0, from the target's argmax of each row (`best`, read already): a one-hot p accepts x iff
    p(x) = 1, and the residual of two different one-hot rows is p, so the rule accepts while a token is its row's
    argmax and corrects the first that is not to it; where every judged token holds and nothing follows (`ends`),
    a spare row gives the bonus token. Row i judges tokens[i]."""
    n, judged = 0, min(len(tokens), len(best))
    while n < judged and tokens[n] == best[n]:
        n += 1
    tried = min(n + 1, judged)
    p, q, u = [1.0] * n + [0.0] * (tried - n), [1.0] * tried, [-1.0] * tried
    if n < judged:
        return Verdict(n, best[n], 1.0, False, p, q, u)
    if ends and len(best) > n:
        return Verdict(n, best[n], 1.0, True, p, q, u)
    return Verdict(n, None, 0.0, False, p, q, u)


ALTERNATIVES = 3  # the alternatives an event shows at a drafted token


def top_alternatives(probs: torch.Tensor, k: int = ALTERNATIVES) -> list[list[float]]:
    """[[token_id, prob], ...] for the k most likely tokens of a row (for the UI's hover and trees)."""
    values, ids = torch.topk(probs, min(k, probs.shape[-1]))
    return alternatives(values.tolist(), ids.tolist())


def alternatives(values: list[float], ids: list) -> list[list[float]]:
    """top_alternatives of a row whose top k (values, ids) were read already."""
    return [[int(i), round(v, 6)] for v, i in zip(values, ids) if v > 0]


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


def without_replacement(q: torch.Tensor, u: list[float]) -> torch.Tensor:
    """draw_candidates(q, len(u), NO_REPLACEMENT) at the uniforms u, left on q's device: [k] (long), candidate i the
    inverse CDF at u_i of q without candidates 1..i-1 (candidate_q's row, the mass left not renormalised: the CDF's
    total does that); -1 where q's support holds fewer than k tokens. Read nowhere."""
    rest, out = q, []
    for u_i in u:
        token = inverse_cdf(rest, torch.tensor([u_i], dtype=torch.float64, device=q.device))
        out.append(token)
        rest = rest.index_fill(0, token.view(1), 0)
    support = (q > 0).sum()
    return torch.where(torch.arange(len(u), device=q.device) < support, torch.stack(out), -1)


def candidate_q(q: torch.Tensor, earlier: list[int], scheme: str) -> torch.Tensor:
    """The distribution candidate i was drawn from, given the candidates drawn before it."""
    if scheme != NO_REPLACEMENT or not earlier:
        return q
    q = q.clone()
    q[earlier] = 0
    return q / q.sum()


def candidate_step(p_i: torch.Tensor, q_i: torch.Tensor, x: int, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(probability [] of accepting candidate x under p_i, p_{i+1} [V] to use if it is rejected), on the rows'
    device."""
    if scheme == TOPK:  # a point mass at x: accept with p_i(x), else remove x from p_i
        rest = p_i.clone()
        rest[x] = 0
        total = rest.sum()
        return p_i[x].double(), torch.where(total > 0, rest / total, p_i)
    return accept_probability(p_i, q_i, x), residual_distribution(p_i, q_i)


@dataclass
class CandidateVerdict:
    index: int | None  # which candidate survived (None: all rejected)
    token: int  # the surviving candidate, or the token sampled from p_{k+1}
    prob: float  # probability of `token` under the distribution it was finally drawn from
    p: list[float]  # p(x_i) for each candidate (under the original p)
    u: list[float]  # the uniform draw for each tried candidate (-1 where greedy needs none)


def verify_candidates(
    p: torch.Tensor,
    q: torch.Tensor,
    candidates: list[int],
    scheme: str,
    generator: torch.Generator | Draws | None,
    greedy: bool,
) -> CandidateVerdict:
    """The multi-candidate rule at one position, computed on the rows' device; the verdict comes to the host in one
    transfer."""
    return settle(check_candidates(p, q, candidates, scheme, generator, greedy))[0]


def check_candidates(
    p: torch.Tensor,
    q: torch.Tensor,
    candidates: list[int],
    scheme: str,
    generator: torch.Generator | Draws | None,
    greedy: bool,
) -> Pending:
    """verify_candidates' arithmetic, left on the rows' device (Pending): the whole chain p_1..p_{k+1} is computed,
    every candidate's acceptance decided at once, and the first accepted one found there; where none is, the token
    is drawn from p_{k+1} (greedy: p's argmax)."""
    draws, k = as_draws(generator), len(candidates)
    ids = torch.tensor(candidates, dtype=torch.long, device=p.device)  # [k]
    p_c = p.gather(0, ids)  # [k]
    if greedy:  # p is one-hot: the rule accepts the candidate that is its argmax, and no step of the chain changes p
        u, accepted, p_i = None, p_c == 1.0, p
    else:
        p_i, a = p, []
        for i, x in enumerate(candidates):
            q_i = candidate_q(q, candidates[:i], scheme)
            a_i, p_i = candidate_step(p_i, q_i, x, scheme)
            a.append(a_i)
        a = torch.stack(a).double() if k else p.new_zeros(0, dtype=torch.float64)  # [k]
        u, accepted = draws.accept(a, until=True)
    first = first_false(~accepted)  # [1]: the first accepted candidate (k: none)
    none = first == k  # [1]
    drawn = (p_i.argmax() if greedy else draws.sample(p_i, none[0])).view(1)
    token = torch.where(none, drawn, ids[first.clamp(max=max(k - 1, 0))]) if k else drawn  # [1]
    prob = torch.where(none, p_i.gather(0, token), p.gather(0, token))  # [1]
    packed = [first, token, prob, p_c] + ([] if greedy else [u])

    def read(v: list[float]) -> CandidateVerdict:
        index, token, prob = int(v[0]), int(v[1]), v[2]
        tried = min(index + 1, k)
        us = [-1.0] * tried if greedy else v[3 + k : 3 + k + tried]
        return CandidateVerdict(None if index == k else index, token, prob, v[3 : 3 + k], us)

    return Pending(torch.cat(packed).double(), read)

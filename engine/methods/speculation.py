"""What the draft has proposed beyond the committed tokens, one record per idea, and what one target pass verifies
of it.

  Drafted      a drafted token with the exact row it was drawn from and what the draft knew of it
  Branch       a fork's candidate and the tokens drafted after it
  Fork         k branches from one position, drafted side by side
  Speculation  a linear path, then maybe a fork
  Feed         what one target pass is fed: the committed tokens it has not seen, a prefix of the path, and where
               the whole path is fed, a prefix of each branch: the path and the branches as one token tree

Rows of a pass. Row r of the pass's logits is the target's distribution of the token after fed token r, so a fed
token's row judges its child: the last committed token's row judges the path's first token, the path's last row
judges the fork's candidates (all of them: the multi-candidate rule), a candidate's row judges its branch's first
token, and the last row of a line judges the first token of it that was not fed (drafted while the target ran), or
gives the bonus token where nothing follows.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch

from engine.models.llama import TokenTree


@dataclass(slots=True)
class Drafted:
    """One drafted token."""

    token: int
    q: torch.Tensor | None  # [V]: exactly the row it was drawn from; None when greedy (a point mass at `token`)
    conf: float  # the draft's untempered probability of it
    top: float | None = None  # the draft's largest untempered probability where it was drafted (None: not kept)
    alts: tuple[float, list[int]] | None = None  # the fork the draft could have made here: (alternatives_share, its
    # top k), so a rejection here tells the rescue table whether a fork would have rescued it (verdict.missed_rescue)


@dataclass(slots=True)
class Branch:
    """A fork's candidate and the tokens drafted after it."""

    candidate: Drafted  # conf: the draft's untempered probability of the candidate; q: the fork's row
    tokens: list[Drafted] = field(default_factory=list)

    def line(self) -> list[Drafted]:
        return [self.candidate, *self.tokens]

    def fed(self) -> list[int]:
        """What its row of the draft cache holds past the fork: each token of its line that a kept branch step
        drafted from (drafting.branch_step), i.e. all but the last."""
        return [d.token for d in self.line()[: len(self.tokens)]]


@dataclass(slots=True)
class Fork:
    """k candidates for one position, each followed by its own drafted branch."""

    q: torch.Tensor  # [V]: the row the candidates were drawn from (greedy: the untempered row, its top k)
    scheme: str  # sampling.TOPK or NO_REPLACEMENT: how they were drawn, which decides the exact rule
    branches: list[Branch]
    depth: int = 0  # path tokens before the branch point when it was forked
    top: float | None = None  # the draft's largest untempered probability at the branch point
    share: float | None = None  # alternatives_share there (what Policy.rescues learns from)
    odds: float = 1.0  # Policy.holds_up there: the odds that one of the candidates survives
    held: bool = False  # a branch step held back (drafting.branch_step): no branch goes further until the verdict
    qx: list[float] = field(default_factory=list)  # each candidate's probability under q (what the event shows)

    @property
    def candidates(self) -> list[int]:
        return [b.candidate.token for b in self.branches]


@dataclass(slots=True)
class Speculation:
    """What the draft has proposed beyond the committed tokens: a linear path, then maybe a fork."""

    path: list[Drafted] = field(default_factory=list)
    fork: Fork | None = None

    def tokens(self) -> list[int]:
        """Every drafted token: the path, then each branch's candidate and tokens."""
        lines = [self.path] + ([b.line() for b in self.fork.branches] if self.fork else [])
        return [d.token for line in lines for d in line]

    def line(self) -> list[Drafted]:
        """The speculation read along its first branch: the draft's own choice at the branch point, and on."""
        return self.path + (self.fork.branches[0].line() if self.fork else [])

    def depth(self) -> int:
        """How far it reaches beyond the committed tokens (a fork counts its candidate and longest branch)."""
        if self.fork is None:
            return len(self.path)
        return len(self.path) + 1 + max(len(b.tokens) for b in self.fork.branches)


@dataclass(frozen=True)
class Feed:
    """What one target pass is fed (see the module's docstring for its rows): `committed`, the committed tokens the
    target has not seen (at least the last one); `path`, how many path tokens follow; `branches[i]`, how many tokens
    of branch i's line (its candidate first) follow the whole path, as a tree (empty: no branch fed)."""

    committed: tuple[int, ...]
    path: int
    branches: tuple[int, ...] = ()

    def ids(self, spec: Speculation) -> list[int]:
        ids = list(self.committed) + [d.token for d in spec.path[: self.path]]
        for n, branch in zip(self.branches, spec.fork.branches if self.branches else []):
            ids += [d.token for d in branch.line()[:n]]
        return ids

    @property
    def size(self) -> int:
        return len(self.committed) + self.path + sum(self.branches)

    def tree(self) -> TokenTree | None:
        """The pass's token tree, or None for a line."""
        if not any(self.branches):
            return None
        line = len(self.committed) + self.path
        parents = list(range(-1, line - 1))
        for n in self.branches:
            if n:  # a line hanging off the path's last token
                parents += [line - 1] + list(range(len(parents), len(parents) + n - 1))
        return TokenTree(tuple(parents))

    def path_rows(self) -> range:
        """The rows that judge path tokens 0, 1, ...: the last committed token's, then each fed path token's."""
        first = len(self.committed) - 1
        return range(first, first + self.path + 1)

    def fork_row(self) -> int:
        """The row that judges the candidates (the whole path was fed)."""
        return len(self.committed) - 1 + self.path

    def branch_start(self, i: int) -> int:
        """Where branch i's line starts among the fed tokens."""
        return len(self.committed) + self.path + sum(self.branches[:i])

    def branch_rows(self, i: int) -> range:
        """The rows that judge branch i's tokens 0, 1, ...: its candidate's, then each fed token's."""
        start = self.branch_start(i)
        return range(start, start + self.branches[i])

    def kept(self, path: int, branch: int | None = None, in_branch: int = 0) -> list[int]:
        """The fed tokens (indices) that a verdict committed: the committed ones, `path` accepted path tokens, and the
        surviving `branch`'s candidate and `in_branch` accepted tokens, as far as they were fed: a line of the tree."""
        rows = list(range(len(self.committed) + min(path, self.path)))
        if branch is not None and branch < len(self.branches) and self.branches[branch]:
            start = self.branch_start(branch)
            rows += list(range(start, start + min(1 + in_branch, self.branches[branch])))
        return rows


def feed_limit(acceptance: list[float], stop: float) -> int:
    """How many leading tokens of a line are worth feeding the target. Feeding token j only pays if tokens
    1..j are all accepted (then its row yields one more token); the odds of that are the product of their
    `acceptance` (Policy.line_acceptance). Below `stop`, a longer verify pass costs more than it is expected to
    return (on a CPU each extra token fed costs a share of a step; 0 feeds everything). Token j+1 is judged all the
    same, by row j."""
    odds, n = 1.0, 0
    for a in acceptance:
        odds *= a
        if odds < stop:
            break
        n += 1
    return n


def plan_branches(line_odds: float, branch_odds: list[list[float]], room: int, stop: float) -> tuple[int, ...]:
    """How many tokens of each branch's line to feed, `room` at most in all: the most likely ones first (EAGLE-2's
    rule for a tree, on SpecBranch's one fork), each while its odds of being reached and accepted stay at least
    `stop`. line_odds: the odds that the path is accepted; branch_odds[i]: the odds of each token of branch i's line,
    given what precedes it. A token's odds are never above its parent's, so what is fed is a tree."""
    fed = [0] * len(branch_odds)
    frontier = [(-line_odds * odds[0], i) for i, odds in enumerate(branch_odds) if odds]
    heapq.heapify(frontier)
    while frontier and room > 0:
        neg, i = heapq.heappop(frontier)
        if -neg < stop:
            break
        fed[i] += 1
        room -= 1
        if fed[i] < len(branch_odds[i]):
            heapq.heappush(frontier, (neg * branch_odds[i][fed[i]], i))
    return tuple(fed)

"""Exact enumeration of the random draws inside engine.methods.sampling's verification functions.

verify_block and verify_candidates take their randomness through a `Draws` (accept each of several tokens with
its probability a_i, in order, until one decision comes out a given way; sample a token from a row). `outcomes(call)`
runs `call(draws)` once per combination of draw outcomes,
each time with a `Script` that fixes every draw, and yields each result with its exact probability (the
product of the probabilities of the outcomes taken), so a test enumerates the engine's own function in
float64 instead of rebuilding its rule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

from engine.methods.sampling import Draws

T = TypeVar("T")


class Script(Draws):
    """Draws whose outcomes follow `script` (outcome indices; past its end: the first possible outcome)."""

    def __init__(self, script: list[int]):
        super().__init__(None)
        self.script = script
        self.taken: list[int] = []  # the outcome taken at each draw
        self.weights: list[list[float]] = []  # the probabilities of every outcome of each draw
        self.prob = 1.0

    def choose(self, weights: list[float]) -> int:
        n = len(self.taken)
        i = self.script[n] if n < len(self.script) else next(j for j, w in enumerate(weights) if w > 0)
        self.taken.append(i)
        self.weights.append(weights)
        self.prob *= weights[i]
        return i

    def accept(self, a: torch.Tensor, until: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Each decision in order, up to the first that comes out `until` (the rest do not count: they are not
        enumerated, and read as `until`)."""
        us, accepted = [], []
        for a_i in a.tolist():
            if accepted and accepted[-1] == until:
                us.append(0.0)
                accepted.append(until)
                continue
            i = self.choose([a_i, 1.0 - a_i])
            us.append(a_i / 2 if i == 0 else (1.0 + a_i) / 2)  # a u on the side of a the outcome is on
            accepted.append(i == 0)
        return torch.tensor(us, dtype=torch.float64), torch.tensor(accepted, dtype=torch.bool)

    def sample(self, probs: torch.Tensor, needed: torch.Tensor | None = None) -> torch.Tensor:
        if needed is not None and not bool(needed):  # the verdict does not use it: no outcome to enumerate
            return torch.tensor(0)
        support = [y for y in range(probs.shape[-1]) if float(probs[y]) > 0]
        return torch.tensor(support[self.choose([float(probs[y]) for y in support])])


def outcomes(call: Callable[[Draws], T]) -> Iterator[tuple[T, float]]:
    """Every result of call(draws) with its exact probability (depth first over the draws' outcomes)."""
    todo: list[list[int]] = [[]]
    while todo:
        draws = Script(todo.pop())
        result = call(draws)
        for depth in range(len(draws.script), len(draws.taken)):  # the draws this run decided on its own
            for alt, w in enumerate(draws.weights[depth]):
                if alt != draws.taken[depth] and w > 0:
                    todo.append(draws.taken[:depth] + [alt])
        yield result, draws.prob

"""Reductions over vocabulary-wide rows on the host, through numpy: each row's argmax, and a probability row's few
largest.

Why not torch's own: on a CPU torch's argmax (and max(dim), and topk) does not vectorize. Over a 49,152-token row
(the embedded target's vocabulary, one thread, the AVX2 machine) torch's argmax takes ~140 us and topk 110-160 us,
where numpy's argmax takes ~16 us; over a verify pass's 6 rows torch's argmax takes ~720 us against 29. The engine
reads such rows at every step: each draft row's token and confidence, each verify pass's greedy verdict, each token
of `ar` (engine/methods/sampling.py read_argmax, read_top), and the draft's process picks the token it steps ahead on
(docs/models.md). numpy's argmax picks torch's token: the first index of the largest value, a NaN counting as the
largest. Where numpy cannot read a tensor (a GPU's, a dtype numpy lacks) the callers run torch's own.
"""

from __future__ import annotations

import numpy as np
import torch

NUMPY_FLOATS = (torch.float32, torch.float64)  # the dtypes read through numpy


def as_numpy(x: torch.Tensor) -> np.ndarray | None:
    """x's values as numpy reads them, sharing its memory, where x is a CPU float32/float64 tensor; else None."""
    if x.device.type != "cpu" or x.dtype not in NUMPY_FLOATS or x.dim() == 0:
        return None
    return x.detach().numpy()


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) [...] (long), as torch computes it; on a CPU by numpy."""
    a = as_numpy(x)
    return x.argmax(-1) if a is None else torch.as_tensor(a.argmax(-1))


def top_indices(probs: np.ndarray, k: int) -> np.ndarray:
    """The indices [n, k] of each probability row's k largest values (probs [n, V], every value >= 0), best first:
    k argmaxes, each pick set to -1 (in a copy) so that the next is another token. A tie goes to the first index
    (torch.topk leaves the order of ties open)."""
    rows = np.arange(probs.shape[0])
    picks = [probs.argmax(-1)]
    if k > 1:
        probs = probs.copy()  # the caller's rows stay as they were
        for _ in range(k - 1):
            probs[rows, picks[-1]] = -1.0
            picks.append(probs.argmax(-1))
    return np.stack(picks, -1)

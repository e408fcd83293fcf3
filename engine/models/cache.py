"""KV-cache helpers. A cache always holds a prefix of the committed token sequence (plus, during a
step, some speculative tokens); rolling back means cropping it to a shorter prefix.

transformers 5 `DynamicCache.crop(n)` takes a *negative* n: the number of positions to remove.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def new_cache(model) -> DynamicCache:
    return DynamicCache(config=model.config)


def cache_length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def cropped_length(length: int, n: int) -> int:
    """A cache's length after crop(n), transformers' semantics: n < 0 drops the last -n positions; n >= 0 keeps the
    first n (for the caches that keep their own length: lean.KVBuffer, draft_process.RemoteCache)."""
    return max(0, length + n) if n < 0 else min(length, n)


def rollback(cache: DynamicCache, keep: int) -> int:
    """Crop the cache to its first `keep` positions; returns how many positions were removed."""
    extra = cache_length(cache) - keep
    if extra < 0:
        raise ValueError(f"cannot roll a cache of {cache_length(cache)} positions back to {keep}")
    if extra:
        cache.crop(-extra)
    return extra


def keep_rows(cache, start: int, rows: list[int]) -> None:
    """Keep, of a pass that began at position `start`, its tokens `rows` (a line of its token tree, in order) and drop
    the rest: a static cache (lean.KVBuffer) moves the kept K and V behind the positions before the pass; any other
    cache takes a line only (a prefix of the pass)."""
    if hasattr(cache, "keep"):
        cache.keep(start, rows)
        return
    if rows != list(range(len(rows))):
        raise ValueError("only a static cache keeps a branch of a token tree")
    rollback(cache, start + len(rows))


def select_row(cache, row: int) -> None:
    """Keep one row of a cache of several (a fork resolved): by its index as a number where the cache takes one
    (the lean draft's BranchKV, a draft in its own process: no tensor read for it), else as transformers' caches do."""
    if hasattr(cache, "select_row"):
        cache.select_row(row)
    else:
        cache.batch_select_indices(torch.tensor([row]))

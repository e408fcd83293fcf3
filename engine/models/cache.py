"""KV-cache helpers. A cache always holds a prefix of the committed token sequence (plus, during a
step, some speculative tokens); rolling back means cropping it to a shorter prefix.

transformers 5 `DynamicCache.crop(n)` takes a *negative* n: the number of positions to remove.
"""

from __future__ import annotations

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

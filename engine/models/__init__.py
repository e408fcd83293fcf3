"""Models: a spec loaded into an LM (loading), KV-cache helpers (cache), and the decode paths with a static KV cache
whose rollback moves a pointer (lean for a draft, static_forward for the target)."""

"""Measurement: the benchmark split (datasets), the bench (every method on the same prompts, ratios against `ar` of
the same run), forward costs and the model of each method's limit (costs), and the metrics, computed from events
alone so that a replay reproduces them (metrics)."""

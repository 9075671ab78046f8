"""What the engine reports about itself: the tps estimators (``tps``) and the metrics read from the
engine's read-only view (``metrics``: per-session and aggregate tps, context headroom, counters,
Prometheus text)."""

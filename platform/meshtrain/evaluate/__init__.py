"""Downstream evaluation of committed checkpoints with lm-evaluation-harness (``lm-eval``)."""

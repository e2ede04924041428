"""Observation: Prometheus metrics and their file_sd targets (``metrics``), Ray Train reports and
TensorBoard (``reporting``), ``metrics.jsonl`` and the driver's progress line (``progress``), and the
files of a run directory (``outputs``)."""

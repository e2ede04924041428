"""Observation: Prometheus metrics and their file_sd targets (``metrics``), Ray Train reports and
TensorBoard (``reporting``), W&B and MLflow (``trackers`` with ``wandb_tracker`` and ``mlflow_tracker``),
``metrics.jsonl`` and the driver's progress line (``progress``), and the files of a run directory
(``outputs``)."""

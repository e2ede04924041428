"""Observation: Prometheus metrics and their file_sd targets (``metrics``), Ray Train reports and
TensorBoard (``reporting``), W&B and MLflow (``trackers`` with ``wandb_tracker`` and ``mlflow_tracker``),
the driver's progress line (``progress``), and the run folder through which the driver and the workers
talk, every file with its one writer and reader (``run_folder``)."""

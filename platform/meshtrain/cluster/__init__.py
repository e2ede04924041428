"""Ray: the checks of a config against the world before anything starts (``preflight``, with the
cluster's capacity in ``capacity``), the workers' plan resolved once from the config (``worker_plan``),
the driver that starts Ray Train (``launcher``, holding the run's
folder through ``run_lease``, building the trainer with ``ray_trainer``, catching Ctrl-C in ``interrupts``,
scoring checkpoints in ``downstream``), what each Ray Train worker runs (``worker``, with ``worker_env``),
the elastic policy (``elastic_policy``), straggler eviction (``eviction``) and how failures are told
apart (``failures``)."""

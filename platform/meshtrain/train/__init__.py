"""One rank's training: what the driver resolves for it (``plan``: the ``WorkerPlan``, the only way the
whole run's settings reach this layer), the trainer and its loop (``trainer``), one optimizer step (``step``), building
the sharded model (``setup``), the parts of the loop (the protocol in ``loop``, their one list in
``parts``: ``evaluation``, ``checkpointing``, ``step_log``, ``mixture_log``, ``records``, ``watchdog`` and
``hangs``, ``preemption``, ``stragglers``, ``profiling``, ``memory_snapshot``, ``gc_schedule``, ``faults``,
``replica_steps``), the step guard (``guard``), AdamW with its LR
schedules (``optim``), and one step traced on fake tensors for the dry run (``trace``)."""

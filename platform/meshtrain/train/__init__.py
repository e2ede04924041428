"""One rank's training, independent of Ray: the trainer and its loop (``trainer``), one optimizer step
(``step``), building the sharded model (``setup``), the named parts of the loop (``evaluation``,
``checkpointing``, ``step_log``, ``records``, ``guard``, ``watchdog`` and ``hangs``, ``preemption``,
``stragglers``, ``profiling``, ``memory_snapshot``, ``gc_schedule``, ``faults``), AdamW with its LR
schedules (``optim``), and one step traced on fake tensors for the dry run (``trace``)."""

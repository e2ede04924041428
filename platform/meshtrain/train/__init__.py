"""One rank's training, independent of Ray: the trainer and its loop (``trainer``), one optimizer step
(``step``), building the sharded model (``setup``), the named parts of the loop (``evaluation``,
``checkpointing``, ``logging``, ``guard``, ``watchdog``, ``gc_schedule``, ``faults``) and AdamW with its
LR schedules (``optim``)."""

"""Ray: the checks of a config against the world before anything starts (``preflight``, with the
cluster's capacity in ``capacity``), the driver that starts Ray Train (``launcher``) and what each
Ray Train worker runs (``worker``)."""

"""Command lines behind ``jobs/``: ``pretrain``, ``prepare_data``, ``export``, ``evaluate``, ``generate``
and ``config_reference`` (docs/configuration.md from the schema), with their shared exit codes and
one-line error handling (``common``)."""

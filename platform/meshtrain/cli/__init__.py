"""Command lines behind ``jobs/``: ``pretrain``, ``prepare_data`` and ``export``, with their shared
one-line error handling (``common``)."""
